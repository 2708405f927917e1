//! Attention over an f32 or f16 KV cache, split across threads by (token, KV head).
//!
//! Each work unit takes one token and one KV head and serves all the query heads that share it,
//! so a cached K or V row is loaded (and converted from f16) once per group, not once per head.
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

/// Per-thread buffers: scores of the group's heads and one converted cache row.
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

/// Attention for one (token, KV head) unit: `q` and `out` hold the group's query heads.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn attend_group<T: KvElem>(
    q: &[f32],
    k_cache: &[T],
    v_cache: &[T],
    kv_head: usize,
    ctx: Context,
    shape: AttentionShape,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let (first, n_ctx) = (ctx.first, ctx.end - ctx.first);
    let row_of =
        |i: usize| cache_row(ctx.table, ctx.page_size, first + i) * shape.kv_width() + kv_head * shape.head_dim;
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    scratch.scores.resize(group * n_ctx, 0.0);
    scratch.row.resize(hd, 0.0);
    let Scratch { scores, row } = scratch;
    for p in 0..n_ctx {
        T::load(&k_cache[row_of(p)..][..hd], row);
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
            scores[h * n_ctx + p] = ctx.scores.apply(acc.iter().sum::<f32>() + tail);
        }
    }
    for h in 0..group {
        let s = &mut scores[h * n_ctx..(h + 1) * n_ctx];
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in s.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        s.iter_mut().for_each(|v| *v *= inv);
    }
    out[..group * hd].fill(0.0);
    for p in 0..n_ctx {
        T::load(&v_cache[row_of(p)..][..hd], row);
        for h in 0..group {
            let w = scores[h * n_ctx + p];
            for (o, &v) in out[h * hd..(h + 1) * hd].iter_mut().zip(row.iter()) {
                *o += w * v;
            }
        }
    }
}

/// [`attend_group`] compiled with more target features than the build's baseline.
macro_rules! attend_group_with {
    ($name:ident, $features:literal) => {
        /// [`attend_group`] compiled with the target features
        #[doc = $features]
        ///
        /// # Safety
        /// The CPU must support those features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name<T: KvElem>(
            q: &[f32],
            k: &[T],
            v: &[T],
            kv_head: usize,
            ctx: Context,
            shape: AttentionShape,
            out: &mut [f32],
            scratch: &mut Scratch,
        ) {
            attend_group(q, k, v, kv_head, ctx, shape, out, scratch)
        }
    };
}

attend_group_with!(attend_group_avx512, "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c");
attend_group_with!(attend_group_avx2, "avx2,fma,f16c");

#[cfg(test)]
mod tests {
    use super::*;

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
