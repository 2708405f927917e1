//! AVX2 (with FMA and F16C) versions of the fast kernels, for x86 CPUs without AVX-512. Each
//! function here must be called only after `Isa::detect()` returned `Avx2` (or better).
//!
//! The repacked 16-row panels are the AVX-512 ones, taken as two halves of eight rows. Without
//! `vpdpbusd`, four-byte dot products are `vpmaddubsw` (u8 x i8 pairs into i16) then
//! `vpmaddwd` against ones: exact while a pair stays below 2^15, which holds for quants up to 6
//! bits; 8-bit quants are split into nibbles first.

use super::repack::{Packing, Repacked, PANEL};
use super::{Q8Activations, CHUNK};
use crate::format::quant::GgmlType;
use std::arch::x86_64::*;
use std::ops::Range;

/// `out[t * n_out + row]` for the rows of `panels` and every token.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `out` must hold `[x.n_tokens, n_out]` values, with no
/// other thread writing the rows of `panels`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmul_repacked(w: &Repacked, x: &Q8Activations, panels: Range<usize>, out: *mut f32, n_out: usize) {
    for p in panels {
        let mut t0 = 0;
        while t0 < x.n_tokens {
            let step = (x.n_tokens - t0).min(2);
            for half in 0..2 {
                match step {
                    2 => half_panel_tile::<2>(w, x, p, half, t0, out, n_out),
                    _ => half_panel_tile::<1>(w, x, p, half, t0, out, n_out),
                }
            }
            t0 += step;
        }
    }
}

#[inline(always)]
unsafe fn broadcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// Four-byte dot products of unsigned `u` (each below 64) and signed `x`, as eight i32.
#[inline(always)]
unsafe fn dot4(u: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
}

/// Eight rows (`half` of panel `p`) against tokens `t0..t0 + T`.
#[inline(always)]
unsafe fn half_panel_tile<const T: usize>(
    w: &Repacked,
    x: &Q8Activations,
    p: usize,
    half: usize,
    t0: usize,
    out: *mut f32,
    n_out: usize,
) {
    let layout = w.layout;
    let (block_len, block_bytes, quant_bytes) = (layout.block_len, layout.block_bytes(), layout.quant_bytes());
    let runs = block_len / 4;
    let base = w.bytes().as_ptr().add(p * w.panel_bytes());
    let stride = x.n_chunks * CHUNK;
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); T];
    for j in 0..w.n_blocks {
        let blk = base.add(j * block_bytes);
        let mut isum = [_mm256_setzero_si256(); T];
        let elem = j * block_len;
        match layout.packing {
            Packing::Nibbles => {
                for v in 0..runs / 2 {
                    let packed = _mm256_loadu_si256(blk.add(v * 64 + half * 32) as *const __m256i);
                    let lo = _mm256_and_si256(packed, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), mask);
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let xq = x.q.as_ptr().add((t0 + t) * stride + elem);
                        *isum = _mm256_add_epi32(*isum, dot4(lo, broadcast4(xq.add(4 * v))));
                        *isum = _mm256_add_epi32(*isum, dot4(hi, broadcast4(xq.add(4 * (v + runs / 2)))));
                    }
                }
            }
            Packing::Bytes => {
                for v in 0..runs {
                    let quants = _mm256_loadu_si256(blk.add(v * 64 + half * 32) as *const __m256i);
                    let lo = _mm256_and_si256(quants, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(quants), mask);
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let xb = broadcast4(x.q.as_ptr().add((t0 + t) * stride + elem + 4 * v));
                        let high = _mm256_slli_epi32::<4>(dot4(hi, xb));
                        *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(dot4(lo, xb), high));
                    }
                }
            }
        }
        let (a, b) = if layout.f32_scales {
            let s = (blk.add(quant_bytes) as *const f32).add(half * 8);
            (_mm256_loadu_ps(s), _mm256_loadu_ps(s.add(PANEL)))
        } else {
            let s = (blk.add(quant_bytes) as *const u16).add(half * 8);
            let load = |p: *const u16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            (load(s), load(s.add(PANEL)))
        };
        for (t, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
            let (dx, sx) = x.block_scales(t0 + t, elem, block_len);
            let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(*isum), a);
            *acc = _mm256_fmadd_ps(scaled, _mm256_set1_ps(dx), *acc);
            *acc = _mm256_fmadd_ps(b, _mm256_set1_ps(sx), *acc);
        }
    }
    let row0 = p * PANEL + half * 8;
    let rows = n_out.saturating_sub(row0).min(8);
    for (t, acc) in acc.iter().enumerate() {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
        for (r, &v) in lanes.iter().enumerate().take(rows) {
            *out.add((t0 + t) * n_out + row0 + r) = v;
        }
    }
}

/// f32 dot product.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8 * k)),
                _mm256_loadu_ps(pb.add(i + 8 * k)),
                *acc,
            );
        }
        i += 32;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    lanes.iter().sum::<f32>() + (i..n).map(|k| a[k] * b[k]).sum::<f32>()
}

/// Converts one row of an F16/BF16/F32 weight to f32.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn float_row(ty: GgmlType, w: &[u8], n_in: usize, row: usize, out: &mut [f32]) {
    let width = ty.block_bytes();
    let src = w.as_ptr().add(row * n_in * width);
    let mut i = 0;
    match ty {
        GgmlType::F16 => {
            while i + 8 <= n_in {
                let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
        }
        GgmlType::BF16 => {
            while i + 8 <= n_in {
                let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
                let wide = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_castsi256_ps(wide));
                i += 8;
            }
        }
        _ => {}
    }
    let tail = &w[(row * n_in + i) * width..(row + 1) * n_in * width];
    super::portable::float_row(ty, tail, n_in - i, 0, &mut out[i..n_in]);
}

/// [`super::quantize_row`] compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    super::quantize_row(x, q, d, s)
}
