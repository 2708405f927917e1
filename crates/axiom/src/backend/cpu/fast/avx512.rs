//! AVX-512 (F, BW, VL, DQ, VNNI) versions of the fast kernels. Each function here must be
//! called only after `Isa::detect()` returned `Avx512Vnni`.

use super::repack::{Packing, Repacked, PANEL};
use super::{Q8Activations, CHUNK};
use crate::format::quant::GgmlType;
use std::arch::x86_64::*;
use std::ops::Range;

/// `out[t * n_out + row]` for the rows of `panels` of a repacked weight and every token, in
/// tiles of one panel by up to four tokens.
///
/// # Safety
/// The CPU must have the enabled features; `out` must hold `[x.n_tokens, n_out]` values, with
/// no other thread writing the rows of `panels`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")]
pub unsafe fn matmul_repacked(w: &Repacked, x: &Q8Activations, panels: Range<usize>, out: *mut f32, n_out: usize) {
    for p in panels {
        let mut t0 = 0;
        while t0 < x.n_tokens {
            let step = (x.n_tokens - t0).min(4);
            match step {
                4 => panel_tile::<4>(w, x, p, t0, out, n_out),
                3 => panel_tile::<3>(w, x, p, t0, out, n_out),
                2 => panel_tile::<2>(w, x, p, t0, out, n_out),
                _ => panel_tile::<1>(w, x, p, t0, out, n_out),
            }
            t0 += step;
        }
    }
}

#[inline(always)]
unsafe fn broadcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// One panel (16 rows) against tokens `t0..t0 + T`: integer sums per block, then scaled.
#[inline(always)]
unsafe fn panel_tile<const T: usize>(
    w: &Repacked,
    x: &Q8Activations,
    p: usize,
    t0: usize,
    out: *mut f32,
    n_out: usize,
) {
    let layout = w.layout;
    let (block_len, block_bytes, quant_bytes) = (layout.block_len, layout.block_bytes(), layout.quant_bytes());
    let runs = block_len / 4;
    let base = w.bytes().as_ptr().add(p * w.panel_bytes());
    let stride = x.n_chunks * CHUNK;
    let mask = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); T];
    for j in 0..w.n_blocks {
        let blk = base.add(j * block_bytes);
        let mut isum = [_mm512_setzero_si512(); T];
        let elem = j * block_len;
        match layout.packing {
            Packing::Nibbles => {
                for v in 0..runs / 2 {
                    let packed = _mm512_loadu_si512(blk.add(v * 64) as *const _);
                    let lo = _mm512_and_si512(packed, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), mask);
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let xq = x.q.as_ptr().add((t0 + t) * stride + elem);
                        *isum = _mm512_dpbusd_epi32(*isum, lo, broadcast4(xq.add(4 * v)));
                        *isum = _mm512_dpbusd_epi32(*isum, hi, broadcast4(xq.add(4 * (v + runs / 2))));
                    }
                }
            }
            Packing::Bytes => {
                for v in 0..runs {
                    let quants = _mm512_loadu_si512(blk.add(v * 64) as *const _);
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let xq = x.q.as_ptr().add((t0 + t) * stride + elem);
                        *isum = _mm512_dpbusd_epi32(*isum, quants, broadcast4(xq.add(4 * v)));
                    }
                }
            }
        }
        let (a, b) = if layout.f32_scales {
            let s = blk.add(quant_bytes) as *const f32;
            (_mm512_loadu_ps(s), _mm512_loadu_ps(s.add(PANEL)))
        } else {
            let s = blk.add(quant_bytes) as *const __m256i;
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(s)),
                _mm512_cvtph_ps(_mm256_loadu_si256(s.add(1))),
            )
        };
        for (t, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
            let (dx, sx) = x.block_scales(t0 + t, elem, block_len);
            let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(*isum), a);
            *acc = _mm512_fmadd_ps(scaled, _mm512_set1_ps(dx), *acc);
            *acc = _mm512_fmadd_ps(b, _mm512_set1_ps(sx), *acc);
        }
    }
    let row0 = p * PANEL;
    let rows = (n_out - row0).min(PANEL);
    let m: __mmask16 = if rows == PANEL { 0xffff } else { (1u16 << rows) - 1 };
    for (t, acc) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(out.add((t0 + t) * n_out + row0), m, *acc);
    }
}

/// f32 dot product.
///
/// # Safety
/// The CPU must have the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16 * k)),
                _mm512_loadu_ps(pb.add(i + 16 * k)),
                *acc,
            );
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
        i += 16;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
        acc[1] = _mm512_fmadd_ps(
            _mm512_maskz_loadu_ps(m, pa.add(i)),
            _mm512_maskz_loadu_ps(m, pb.add(i)),
            acc[1],
        );
    }
    _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ))
}

/// Converts one row of an F16/BF16/F32 weight to f32.
///
/// # Safety
/// The CPU must have the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c")]
pub unsafe fn float_row(ty: GgmlType, w: &[u8], n_in: usize, row: usize, out: &mut [f32]) {
    let width = ty.block_bytes();
    let src = w.as_ptr().add(row * n_in * width);
    let mut i = 0;
    match ty {
        GgmlType::F16 => {
            while i + 16 <= n_in {
                let h = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
                i += 16;
            }
        }
        GgmlType::BF16 => {
            while i + 16 <= n_in {
                let h = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
                let wide = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_castsi512_ps(wide));
                i += 16;
            }
        }
        _ => {}
    }
    let tail = &w[(row * n_in + i) * width..(row + 1) * n_in * width];
    super::portable::float_row(ty, tail, n_in - i, 0, &mut out[i..n_in]);
}

/// [`super::quantize_row`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    super::quantize_row(x, q, d, s)
}
