//! AVX-512 (F, BW, VL, DQ, VNNI) versions of the fast kernels. Each function here must be
//! called only after `Isa::detect()` returned `Avx512Vnni`.

use super::portable::scale_min_k4;
use super::{Q8Activations, Stage, CHUNK, GROUPS_PER_CHUNK};
use crate::format::quant::GgmlType;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn f16_to_f32(b: &[u8], i: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes([b[i], b[i + 1]]))))
}

/// Sixteen lanes: `lo` in the first eight, `hi` in the last eight.
#[inline(always)]
unsafe fn halves(lo: f32, hi: f32) -> __m512 {
    _mm512_insertf32x8::<1>(_mm512_castps256_ps512(_mm256_set1_ps(lo)), _mm256_set1_ps(hi))
}

/// The low and high nibbles of 16 bytes, as 32 bytes: `[lo..., hi...]`.
#[inline(always)]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Stores chunk `c` of stage slot `slot`.
#[inline(always)]
unsafe fn put(stage: &mut Stage, slot: usize, c: usize, u: __m512i, a: __m512, b: __m512) {
    let chunk = slot * stage.n_chunks + c;
    _mm512_storeu_si512(stage.u.as_mut_ptr().add(chunk * CHUNK) as *mut _, u);
    _mm512_storeu_ps(stage.a.as_mut_ptr().add(chunk * GROUPS_PER_CHUNK), a);
    _mm512_storeu_ps(stage.b.as_mut_ptr().add(chunk * GROUPS_PER_CHUNK), b);
}

/// Unpacks row `row` of a `[n_out, n_in]` weight into stage slot `slot` (see `portable::unpack_row`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")]
pub unsafe fn unpack_row(ty: GgmlType, w: &[u8], n_in: usize, row: usize, stage: &mut Stage, slot: usize) {
    let row_bytes = ty.bytes_for(n_in).expect("validated row length");
    let src = &w[row * row_bytes..(row + 1) * row_bytes];
    let full_chunks = n_in / CHUNK;
    if n_in % CHUNK != 0 {
        // A row ending in half a chunk: the portable code writes the tail and the padding, and
        // the full chunks are overwritten below.
        super::portable::unpack_row(ty, w, n_in, row, stage, slot);
    }
    match ty {
        GgmlType::Q8_0 => {
            let flip = _mm512_set1_epi8(-128);
            for c in 0..full_chunks {
                let (b0, b1) = (&src[c * 68..], &src[c * 68 + 34..]);
                let (d0, d1) = (f16_to_f32(b0, 0), f16_to_f32(b1, 0));
                let q0 = _mm256_loadu_si256(b0.as_ptr().add(2) as *const __m256i);
                let q1 = _mm256_loadu_si256(b1.as_ptr().add(2) as *const __m256i);
                let u = _mm512_xor_si512(join(q0, q1), flip);
                put(stage, slot, c, u, halves(d0, d1), halves(-128.0 * d0, -128.0 * d1));
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (bytes, qs_at) = if ty == GgmlType::Q4_0 { (18, 2) } else { (20, 4) };
            for c in 0..full_chunks {
                let (b0, b1) = (&src[2 * c * bytes..], &src[(2 * c + 1) * bytes..]);
                let (d0, d1) = (f16_to_f32(b0, 0), f16_to_f32(b1, 0));
                let (o0, o1) = if ty == GgmlType::Q4_0 {
                    (-8.0 * d0, -8.0 * d1)
                } else {
                    (f16_to_f32(b0, 2), f16_to_f32(b1, 2))
                };
                let u = join(nibbles16(b0.as_ptr().add(qs_at)), nibbles16(b1.as_ptr().add(qs_at)));
                put(stage, slot, c, u, halves(d0, d1), halves(o0, o1));
            }
        }
        GgmlType::Q4K => {
            let mask = _mm256_set1_epi8(0x0f);
            for (i, blk) in src.chunks_exact(144).enumerate() {
                let (d, dmin) = (f16_to_f32(blk, 0), f16_to_f32(blk, 2));
                for j in 0..4 {
                    let q = _mm256_loadu_si256(blk.as_ptr().add(16 + 32 * j) as *const __m256i);
                    let lo = _mm256_and_si256(q, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
                    let (sc0, m0) = scale_min_k4(2 * j, &blk[4..16]);
                    let (sc1, m1) = scale_min_k4(2 * j + 1, &blk[4..16]);
                    let a = halves(d * sc0 as f32, d * sc1 as f32);
                    let b = halves(-dmin * m0 as f32, -dmin * m1 as f32);
                    put(stage, slot, 4 * i + j, join(lo, hi), a, b);
                }
            }
        }
        GgmlType::Q6K => {
            let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
            for (i, blk) in src.chunks_exact(210).enumerate() {
                let d = f16_to_f32(blk, 208);
                for half in 0..2 {
                    let l0 = _mm256_loadu_si256(blk.as_ptr().add(64 * half) as *const __m256i);
                    let l1 = _mm256_loadu_si256(blk.as_ptr().add(64 * half + 32) as *const __m256i);
                    let h = _mm256_loadu_si256(blk.as_ptr().add(128 + 32 * half) as *const __m256i);
                    let high =
                        |shift: __m128i| _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(h, shift), m2));
                    let low = |l: __m256i, shift: __m128i| _mm256_and_si256(_mm256_srl_epi16(l, shift), m4);
                    let sh = |n: i64| _mm_set_epi64x(0, n);
                    for j in 0..2 {
                        let v0 = _mm256_or_si256(low(l0, sh(4 * j as i64)), high(sh(4 * j as i64)));
                        let v1 = _mm256_or_si256(low(l1, sh(4 * j as i64)), high(sh(4 * j as i64 + 2)));
                        // Four groups of sixteen values, each with its own scale.
                        let sc = |g: usize| d * blk[192 + half * 8 + 4 * j + g] as i8 as f32;
                        let scales = _mm_set_ps(sc(3), sc(2), sc(1), sc(0));
                        let idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                        let a = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scales));
                        let b = _mm512_mul_ps(a, _mm512_set1_ps(-32.0));
                        put(stage, slot, 4 * i + 2 * half + j, join(v0, v1), a, b);
                    }
                }
            }
        }
        _ => unreachable!("{ty} has no integer kernel"),
    }
}

/// Dot products of `R` staged rows (slots `0..R`) with `T` tokens starting at `t0`:
/// `out[r][t]`. The integer products of each group are scaled per lane, so nothing is reduced
/// horizontally until the end of the row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn tile<const R: usize, const T: usize>(
    stage: &Stage,
    slot0: usize,
    x: &Q8Activations,
    t0: usize,
    out: &mut [[f32; T]; R],
) {
    let n_chunks = stage.n_chunks;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let (su, sa, sb) = (stage.u.as_ptr(), stage.a.as_ptr(), stage.b.as_ptr());
    let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
    for c in 0..n_chunks {
        let mut u = [_mm512_setzero_si512(); R];
        let mut a = [_mm512_setzero_ps(); R];
        let mut b = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let chunk = (slot0 + r) * n_chunks + c;
            u[r] = _mm512_loadu_si512(su.add(chunk * CHUNK) as *const _);
            a[r] = _mm512_loadu_ps(sa.add(chunk * GROUPS_PER_CHUNK));
            b[r] = _mm512_loadu_ps(sb.add(chunk * GROUPS_PER_CHUNK));
        }
        for t in 0..T {
            let chunk = (t0 + t) * n_chunks + c;
            let q = _mm512_loadu_si512(xq.add(chunk * CHUNK) as *const _);
            let d = _mm512_loadu_ps(xd.add(chunk * GROUPS_PER_CHUNK));
            let s = _mm512_loadu_ps(xs.add(chunk * GROUPS_PER_CHUNK));
            for r in 0..R {
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r], q);
                let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), a[r]);
                acc[r][t] = _mm512_fmadd_ps(scaled, d, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(b[r], s, acc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
}

/// `out[t * n_out + row0 + r]` for the `rows` staged rows and every token, in tiles of four
/// rows by up to three tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub unsafe fn dot_rows(stage: &Stage, rows: usize, x: &Q8Activations, out: *mut f32, n_out: usize, row0: usize) {
    macro_rules! run {
        ($r:literal, $t:literal, $slot:expr, $t0:expr) => {{
            let mut o = [[0f32; $t]; $r];
            tile::<$r, $t>(stage, $slot, x, $t0, &mut o);
            for r in 0..$r {
                for t in 0..$t {
                    *out.add(($t0 + t) * n_out + row0 + $slot + r) = o[r][t];
                }
            }
        }};
    }
    let mut t0 = 0;
    while t0 < x.n_tokens {
        let step = (x.n_tokens - t0).min(3);
        if rows == 4 {
            match step {
                3 => run!(4, 3, 0, t0),
                2 => run!(4, 2, 0, t0),
                _ => run!(4, 1, 0, t0),
            }
        } else {
            for slot in 0..rows {
                match step {
                    3 => run!(1, 3, slot, t0),
                    2 => run!(1, 2, slot, t0),
                    _ => run!(1, 1, slot, t0),
                }
            }
        }
        t0 += step;
    }
}

/// f32 dot product.
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    super::quantize_row(x, q, d, s)
}
