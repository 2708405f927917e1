//! Attention over an f32 or f16 KV cache, split across threads by (tile of tokens, KV head).
//!
//! Each work unit takes up to [`TILE`] consecutive tokens of one sequence and one KV head, and
//! serves all the query heads that share it, so a cached K or V row is loaded (and converted from
//! f16) once per tile and group, not once per token and head.
//! The loops are plain Rust, compiled again with AVX2 or AVX-512 enabled for those CPUs.

use crate::backend::cpu::kernels::paged::cache_row;
use crate::backend::{AttentionShape, Scores};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// An element type the KV cache can hold.
pub trait KvElem: Copy + Send + Sync {
    fn load(src: &[Self], dst: &mut [f32]);
    fn store(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    #[inline(always)]
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn load(src: &[f16], dst: &mut [f32]) {
        // Branch-free widening the compiler vectorises (no per-call feature detection): the
        // exponent is rebased by multiplying by 2^112, which also handles subnormals.
        for (d, &h) in dst.iter_mut().zip(src) {
            let h = h.to_bits() as u32;
            let magnitude = if h & 0x7c00 == 0x7c00 {
                f32::from_bits(0x7f80_0000 | ((h & 0x03ff) << 13))
            } else {
                f32::from_bits((h & 0x7fff) << 13) * f32::from_bits(0x7780_0000)
            };
            *d = f32::from_bits(magnitude.to_bits() | ((h & 0x8000) << 16));
        }
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Query tokens one work unit takes at most: consecutive positions of one sequence, which read
/// the same cached rows, so that each row is loaded (and widened from f16) once for all of them.
pub const TILE: usize = 8;

/// Per-thread buffers: scores of the tile's tokens and heads, and one converted cache row.
#[derive(Default)]
pub struct Scratch {
    scores: Vec<f32>,
    row: Vec<f32>,
}

/// The part of the paged cache one token reads: its sequence's pages and the positions it sees,
/// with how it scores them.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    pub table: &'a [u32],
    pub page_size: usize,
    /// The positions `first..end`.
    pub first: usize,
    pub end: usize,
    pub scores: Scores,
}

/// Attention for one unit: the tokens of `tile` (one sequence's, so one page table) and one KV
/// head. `qs[j]` and `outs[j]` hold token j's query heads of that KV head's group. Each token's
/// arithmetic is the same whatever else is in its tile, so results do not depend on the batch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn attend_tile<T: KvElem>(
    qs: &[&[f32]],
    k_cache: &[T],
    v_cache: &[T],
    kv_head: usize,
    tile: &[Context],
    shape: AttentionShape,
    outs: &mut [&mut [f32]],
    scratch: &mut Scratch,
) {
    let (hd, group) = (shape.head_dim, shape.n_heads / shape.n_kv_heads);
    let (table, page_size) = (tile[0].table, tile[0].page_size);
    let row_of = |p: usize| cache_row(table, page_size, p) * shape.kv_width() + kv_head * hd;
    let first = tile.iter().map(|c| c.first).min().unwrap_or(0);
    let end = tile.iter().map(|c| c.end).max().unwrap_or(0);
    // Token j's scores for head h: `group` runs of its visible positions from `starts[j]`.
    let mut starts = [0usize; TILE];
    let mut total = 0;
    for (start, c) in starts.iter_mut().zip(tile) {
        *start = total;
        total += group * (c.end - c.first);
    }
    scratch.scores.resize(total, 0.0);
    scratch.row.resize(hd, 0.0);
    let Scratch { scores, row } = scratch;
    for p in first..end {
        T::load(&k_cache[row_of(p)..][..hd], row);
        for ((c, q), &start) in tile.iter().zip(qs).zip(&starts) {
            if !(c.first..c.end).contains(&p) {
                continue;
            }
            let n_ctx = c.end - c.first;
            for h in 0..group {
                let qh = &q[h * hd..(h + 1) * hd];
                let mut acc = [0f32; 16];
                for (qc, kc) in qh.chunks_exact(16).zip(row.chunks_exact(16)) {
                    for i in 0..16 {
                        acc[i] += qc[i] * kc[i];
                    }
                }
                let tail: f32 = qh
                    .chunks_exact(16)
                    .remainder()
                    .iter()
                    .zip(row.chunks_exact(16).remainder())
                    .map(|(a, b)| a * b)
                    .sum();
                scores[start + h * n_ctx + p - c.first] = c.scores.apply(acc.iter().sum::<f32>() + tail);
            }
        }
    }
    for (c, &start) in tile.iter().zip(&starts) {
        let n_ctx = c.end - c.first;
        scores[start..start + group * n_ctx]
            .chunks_exact_mut(n_ctx.max(1))
            .for_each(softmax);
    }
    for out in outs.iter_mut() {
        out[..group * hd].fill(0.0);
    }
    for p in first..end {
        T::load(&v_cache[row_of(p)..][..hd], row);
        for ((c, out), &start) in tile.iter().zip(outs.iter_mut()).zip(&starts) {
            if !(c.first..c.end).contains(&p) {
                continue;
            }
            let n_ctx = c.end - c.first;
            for h in 0..group {
                let w = scores[start + h * n_ctx + p - c.first];
                for (o, &v) in out[h * hd..(h + 1) * hd].iter_mut().zip(row.iter()) {
                    *o += w * v;
                }
            }
        }
    }
}

/// Softmax in place, in 16 lanes (max and sum) so that it vectorises.
#[inline(always)]
fn softmax(s: &mut [f32]) {
    let mut lanes = [f32::NEG_INFINITY; 16];
    for c in s.chunks_exact(16) {
        for i in 0..16 {
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    let max = s
        .chunks_exact(16)
        .remainder()
        .iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for v in s.iter_mut() {
        *v = exp(*v - max);
    }
    let mut lanes = [0f32; 16];
    for c in s.chunks_exact(16) {
        for i in 0..16 {
            lanes[i] += c[i];
        }
    }
    let sum = lanes.iter().sum::<f32>() + s.chunks_exact(16).remainder().iter().sum::<f32>();
    let inv = 1.0 / sum;
    s.iter_mut().for_each(|v| *v *= inv);
}

/// `e^x` without a call into libm, so that a loop of it vectorises: 2^n times Cephes' degree-6
/// polynomial on the remainder (within 2 ulp of the exact value); 0 below -87.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let n = (x.max(-87.0) * std::f32::consts::LOG2_E).round();
    // ln 2 in two parts, so that n * ln 2 is exact enough for the remainder.
    let r = x.max(-87.0) - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = (((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r
        + 0.5)
        * r
        * r
        + r
        + 1.0;
    let value = p * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        value
    }
}

/// [`attend_tile`] compiled with more target features than the build's baseline.
macro_rules! attend_tile_with {
    ($name:ident, $features:literal) => {
        /// [`attend_tile`] compiled with the target features
        #[doc = $features]
        ///
        /// # Safety
        /// The CPU must support those features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name<T: KvElem>(
            qs: &[&[f32]],
            k: &[T],
            v: &[T],
            kv_head: usize,
            tile: &[Context],
            shape: AttentionShape,
            outs: &mut [&mut [f32]],
            scratch: &mut Scratch,
        ) {
            attend_tile(qs, k, v, kv_head, tile, shape, outs, scratch)
        }
    };
}

attend_tile_with!(attend_tile_avx512, "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c");
attend_tile_with!(attend_tile_avx2, "avx2,fma,f16c");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_exact_value() {
        for i in 0..=2_000_000 {
            let x = -87.0 + 87.0 * i as f32 / 2e6;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            let ulp = (want as f32).next_up() as f64 - want as f32 as f64;
            assert!((got - want).abs() <= 2.0 * ulp, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut wide = vec![0f32; halves.len()];
        f16::load(&halves, &mut wide);
        for (h, w) in halves.iter().zip(&wide) {
            let want = h.to_f32();
            assert!(
                want.to_bits() == w.to_bits() || (want.is_nan() && w.is_nan()),
                "{:#06x}",
                h.to_bits()
            );
        }
    }
}
