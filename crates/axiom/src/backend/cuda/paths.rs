//! Which kernels a step's ops may take: the fastest for the step's size, or one set for every
//! step, so that a token's arithmetic depends on its own row and context only, not on what else
//! the step holds (`--deterministic`, docs/reproducibility.md). Each op's plan function
//! (`matmul_plan`, `projection_plan`, `rope_plan`, `takes_flash`, the attention's splits) asks
//! here, and nowhere else is the choice made.

use super::flash_attention::FLASH_MIN_TOKENS;
use super::kernels;
use super::matmul::GEMV_MAX_TOKENS;
use crate::format::quant::GgmlType;

/// Steps of up to this many tokens are recorded as CUDA graphs where every matmul runs on the
/// matrix-vector kernels for any step (`Paths::BatchInvariant`): a decode step of 64 streams.
const INVARIANT_CAPTURE_MAX_TOKENS: usize = 64;

/// The kernels a step may take.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Paths {
    /// Chosen by the step's size: cuBLAS for longer steps, flash attention for 32 tokens or
    /// more, context splits by the step's heads, norms and RoPE fused where the step allows.
    /// The default.
    Fastest,
    /// The same for every step: the matrix-vector kernels for every token count, one RMS norm
    /// kernel, the one-pass attention without context splits, RoPE in its own launch.
    BatchInvariant,
}

impl Paths {
    /// Tokens up to which a matmul of weights of type `ty` uses the matrix-vector kernels rather
    /// than cuBLAS. Fastest: float weights go to cuBLAS from two tokens on (nothing to
    /// dequantize, and the kernels' activation reads grow with every token), quantized ones
    /// above `GEMV_MAX_TOKENS`. Invariant: never, since cuBLAS sums in another order (and picks
    /// its tiling by the token count).
    pub(super) fn gemv_max_tokens(self, ty: GgmlType) -> usize {
        match (self, ty) {
            (Paths::BatchInvariant, _) => usize::MAX,
            (Paths::Fastest, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) => 1,
            (Paths::Fastest, _) => GEMV_MAX_TOKENS,
        }
    }

    /// Whether a matmul of `ty` may run on int8 activations (not FP8's: `has_int8_kernels`). Not
    /// Q4_K's when invariant: its one-token kernel takes two rows a warp and starts each pair at
    /// its own stage, so it sums a row's stages in another order than its kernels for more
    /// tokens; its f32 kernels take a lane's chunks in one order for any token count.
    pub(super) fn int8_activations(self, ty: GgmlType) -> bool {
        kernels::has_int8_kernels(ty) && !(self == Paths::BatchInvariant && ty == GgmlType::Q4K)
    }

    /// Whether the expert products of steps of a few tokens (per (token, expert) pair) may run
    /// on int8 activations for experts of `ty`. Not when invariant: longer steps group the pairs
    /// by expert and take f32 activations, and a token's sums must not depend on which path its
    /// step takes.
    pub(super) fn int8_experts(self, ty: GgmlType) -> bool {
        self == Paths::Fastest && kernels::has_int8_kernels(ty)
    }

    /// Whether an RMS norm may be folded into what reads its rows (the matrix-vector kernels,
    /// the int8 quantization, the 16-bit conversion for cuBLAS). Each of those reduces the row
    /// its own way, so invariant steps normalize by `rms_norm` only, whichever path reads it.
    pub(super) fn folds_norms(self) -> bool {
        self == Paths::Fastest
    }

    /// Whether a few tokens' router product and routing may run as one launch (router_route):
    /// its sums are not the matrix-vector kernels', so invariant steps keep the router on those
    /// at every step size.
    pub(super) fn fuses_routing(self) -> bool {
        self == Paths::Fastest
    }

    /// Whether the expert products of a step whose pairs are grouped by expert may run on the
    /// tensor cores (f16 or bf16 inputs, tiles of slots) for weights of type `ty`: those with such
    /// kernels (`kernels::has_expert_gemm`), under Fastest. Invariant steps keep every expert
    /// product on the row dot products, whose sums do not depend on how many pairs share an expert.
    pub(super) fn expert_gemm(self, ty: GgmlType) -> bool {
        self == Paths::Fastest && kernels::has_expert_gemm(ty)
    }

    /// Whether FP8 weights' products may run on the tensor cores: a few tokens' on mma.sync, their
    /// activations rounded to f16; prompts' on the FP8 tensor cores through cuBLASLt (which
    /// chooses its kernel by the step's size). Not when invariant: the f32 kernels' sums match the
    /// reference's to f32 rounding.
    pub(super) fn fp8_tensor_cores(self) -> bool {
        self == Paths::Fastest
    }

    /// Whether attention may run on tensor cores (flash attention, f16 queries and
    /// probabilities) for steps long enough: invariant steps take the one-pass kernel always.
    pub(super) fn flash(self) -> bool {
        self == Paths::Fastest
    }

    /// Whether a step of one token may rotate its query and key inside attention: invariant
    /// steps rotate and store them by `rope_kv_write` at every step size.
    pub(super) fn rope_in_attention(self) -> bool {
        self == Paths::Fastest
    }

    /// Blocks of the one-pass attention that share each head's context, `max_splits` at most.
    /// Fastest: as many as leave no multiprocessor idle over the step's `heads` (tokens times
    /// query heads), which cuts a context and merges it by the step's size. Invariant: one.
    pub(super) fn attention_splits(self, multiprocessors: usize, heads: usize, max_splits: usize) -> usize {
        match self {
            Paths::Fastest => (multiprocessors / heads).clamp(1, max_splits),
            Paths::BatchInvariant => 1,
        }
    }

    /// The most tokens a step may have to be recorded as a CUDA graph, before the weights are
    /// known (`upload_weight` lowers it to their `gemv_max_tokens`): only steps whose matmuls all
    /// run on our own kernels are recorded.
    pub(super) fn capture_max_tokens(self) -> usize {
        match self {
            Paths::Fastest => GEMV_MAX_TOKENS,
            Paths::BatchInvariant => INVARIANT_CAPTURE_MAX_TOKENS,
        }
    }

    /// Tokens whose activations the int8 staging holds, for steps of at most `max_tokens`: those
    /// that reach the integer kernels.
    pub(super) fn int8_tokens(self, max_tokens: usize) -> usize {
        match self {
            Paths::Fastest => GEMV_MAX_TOKENS.min(max_tokens),
            Paths::BatchInvariant => max_tokens,
        }
    }

    /// Whether steps of `max_tokens` may send quantized weights to cuBLAS (and so need its
    /// 16-bit staging).
    pub(super) fn uses_cublas(self, max_tokens: usize) -> bool {
        self == Paths::Fastest && max_tokens > GEMV_MAX_TOKENS
    }

    /// Whether steps of `max_tokens` may run flash attention (and so need its tiles).
    pub(super) fn uses_flash(self, max_tokens: usize) -> bool {
        self.flash() && max_tokens >= FLASH_MIN_TOKENS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invariant_paths_choose_alike_for_every_step() {
        let p = Paths::BatchInvariant;
        for ty in [GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K] {
            assert_eq!(p.gemv_max_tokens(ty), usize::MAX);
        }
        assert!(!p.int8_activations(GgmlType::Q4K) && p.int8_activations(GgmlType::Q8_0));
        assert!(!p.int8_activations(GgmlType::BF16));
        assert!(!p.folds_norms() && !p.flash() && !p.rope_in_attention() && !p.fp8_tensor_cores());
        assert!(!p.int8_experts(GgmlType::Q4K) && !p.int8_experts(GgmlType::Q8_0));
        for heads in [1, 9, 32, 2048] {
            assert_eq!(p.attention_splits(132, heads, 8), 1);
        }
        assert!(!p.uses_cublas(8192) && !p.uses_flash(8192));
        assert!(!p.expert_gemm(GgmlType::Q4K) && !p.expert_gemm(GgmlType::BF16));
        assert_eq!((p.int8_tokens(512), p.capture_max_tokens()), (512, 64));
        // The default is unchanged: cuBLAS from two tokens for float weights, nine for quantized,
        // splits by the step's heads.
        let f = Paths::Fastest;
        assert_eq!(
            (f.gemv_max_tokens(GgmlType::BF16), f.gemv_max_tokens(GgmlType::Q4K)),
            (1, 8)
        );
        assert!(f.int8_activations(GgmlType::Q4K) && f.fp8_tensor_cores());
        assert!(f.expert_gemm(GgmlType::Q4K) && f.expert_gemm(GgmlType::BF16) && !f.expert_gemm(GgmlType::F32));
        assert!(f.int8_experts(GgmlType::Q4K) && !f.int8_experts(GgmlType::BF16));
        // FP8 weights stay off int8 activations, on the matrix-vector kernels up to eight tokens.
        assert!(!f.int8_activations(GgmlType::Fp8) && !p.int8_activations(GgmlType::Fp8));
        assert!(!f.int8_experts(GgmlType::Fp8) && !f.expert_gemm(GgmlType::Fp8));
        assert_eq!(f.gemv_max_tokens(GgmlType::Fp8), 8);
        assert!(f.fp8_tensor_cores());
        assert_eq!((f.attention_splits(132, 32, 8), f.attention_splits(132, 1, 8)), (4, 8));
        assert_eq!((f.int8_tokens(512), f.capture_max_tokens()), (8, 8));
    }
}
