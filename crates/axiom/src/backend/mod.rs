//! The narrow interface every compute backend implements, and the backends themselves.
//!
//! A backend has four layers: a device (what it runs on), a context (the queue or
//! stream work is submitted to), an allocator (one arena reserved up front, handing out
//! [`BlockHandle`]s) and kernels (one per op), which [`Kernels`] (kernels.rs) names. The model's
//! layer loop is written once against [`Backend`] (fused.rs): the model-level ops, with default
//! compositions of those kernels. Activations and the KV cache live in arena blocks, weights in
//! whatever form the backend keeps them (the CPU reads them straight from the memory-mapped file).
//!
//! Buffer conventions: activations are row-major f32 `[n_tokens, width]`; token ids and positions
//! are u32; a weight matrix `[n_out, n_in]` is stored row by row in its GGUF type, so
//! `matmul` computes `out[t, o] = sum_i x[t, i] * w[o, i]`.

pub mod arena;
pub mod cpu;
pub mod cuda;
mod experts;
mod fused;
mod kernels;
#[cfg(any(target_vendor = "apple", axiom_metal_check))]
pub mod metal;

pub use arena::{Arena, ArenaError, BlockHandle};
pub use experts::{ExpertScratch, ExpertSet, Routes, Routing};
pub use fused::{
    add_shared_expert, attend_and_project_in_steps, feed_forward_in_steps, gate_up_glu_in_steps, mixture_in_steps,
    rope_attend_and_project_in_steps, rope_kv_write_in_steps, Backend, FeedForward, FeedForwardScratch, GluRows,
    Mixture, MixtureScratch, NewRows, Projection, Residual, SharedExpert,
};
use kernels::choices_at_once;
pub use kernels::Kernels;

use crate::format::quant::GgmlType;
use crate::Result;

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs (x[2i], x[2i+1]): GGUF's "normal" layout (Llama Q/K are permuted into it).
    Adjacent,
    /// Rotate-half pairs (x[i], x[i + d/2]): Hugging Face's layout, GGUF's "NeoX".
    Halves,
}

/// Rotary embedding settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub layout: RopeLayout,
    pub theta: f32,
    /// Number of leading dimensions of each head that are rotated (`partial_rotary_factor` of
    /// the head, or all of it); the rest pass through unrotated.
    pub dims: usize,
    pub scaling: RopeScaling,
    /// Factor on the cosine and sine (YaRN's and LongRoPE's attention factor, 1 otherwise): it
    /// scales the rotated dimensions of Q and K only, as transformers applies it.
    pub scale: f32,
}

/// How a model stretches its rotary frequencies beyond the context it was trained on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: usize,
    },
    Yarn(Yarn),
    /// LongRoPE (Phi-3): each pair's frequency divided by its own factor, the short list's when
    /// every sequence fits `original_context`, the long list's otherwise; the lists live in
    /// `ModelConfig::longrope`.
    LongRope {
        original_context: usize,
    },
}

/// YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
/// divided by `factor`, those turning more than `beta_fast` times kept, a linear ramp between (its
/// ends rounded outwards when `truncate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_context: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub truncate: bool,
}

impl Yarn {
    /// The ramp at pair `i` of `dims` rotated dimensions turning at `theta`: 0 keeps the pair's
    /// frequency, 1 divides it by the factor.
    fn ramp(&self, i: usize, dims: f64, theta: f64) -> f64 {
        let correction_dim = |rotations: f64| {
            dims * (self.original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast as f64),
            correction_dim(self.beta_slow as f64),
        );
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dims - 1.0));
        if low == high {
            high += 0.001;
        }
        ((i as f64 - low) / (high - low)).clamp(0.0, 1.0)
    }
}

impl std::fmt::Display for Yarn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "YaRN x{} beyond {} tokens (beta {}/{}{})",
            self.factor,
            self.original_context,
            self.beta_fast,
            self.beta_slow,
            if self.truncate { "" } else { ", not truncated" }
        )
    }
}

impl std::fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RopeScaling::None => write!(f, "none"),
            RopeScaling::Linear { factor } => write!(f, "linear x{factor}"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => write!(
                f,
                "llama3 x{factor} beyond {original_context} tokens (frequency factors {low_freq_factor}..{high_freq_factor})"
            ),
            RopeScaling::Yarn(yarn) => write!(f, "{yarn}"),
            RopeScaling::LongRope { original_context } => write!(
                f,
                "LongRoPE (short factors while the context served fits {original_context} tokens, long beyond)"
            ),
        }
    }
}

impl std::fmt::Display for Rope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} layout, theta {}, {} dims rotated, scaling {}",
            self.layout, self.theta, self.dims, self.scaling
        )?;
        if self.scale != 1.0 {
            write!(f, ", attention factor {}", self.scale)?;
        }
        Ok(())
    }
}

/// YaRN's attention factor for a context stretched by `factor` (the paper's `0.1 ln(s) + 1`
/// times `mscale`), 1 when it is not stretched.
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

impl Rope {
    /// The angle per position of each rotated pair, `theta^(-2i/dims)` after scaling, as
    /// transformers computes it (LongRoPE's per-pair factors are applied by the config). The rope
    /// kernels read this table.
    pub fn inverse_frequencies(&self) -> Vec<f32> {
        let dims = self.dims as f64;
        let half = self.dims / 2;
        (0..half)
            .map(|i| {
                let base = (self.theta as f64).powf(-2.0 * i as f64 / dims);
                let f = match self.scaling {
                    RopeScaling::None | RopeScaling::LongRope { .. } => base,
                    RopeScaling::Linear { factor } => base / factor as f64,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_context,
                    } => {
                        let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        let (low_wavelen, high_wavelen) =
                            (original_context as f64 / low, original_context as f64 / high);
                        if wavelen < high_wavelen {
                            base
                        } else if wavelen > low_wavelen {
                            base / factor
                        } else {
                            let smooth = (original_context as f64 / wavelen - low) / (high - low);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                    RopeScaling::Yarn(yarn) => {
                        let ramp = yarn.ramp(i, dims, self.theta as f64);
                        base / yarn.factor as f64 * ramp + base * (1.0 - ramp)
                    }
                };
                f as f32
            })
            .collect()
    }
}

/// The activation of a gated feed-forward block's gate: `out = act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `g / (1 + e^-g)`: SwiGLU (Llama, Mistral, Qwen).
    Silu,
    /// GELU by its tanh approximation, `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`: GeGLU
    /// (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The number the GPU kernels take for it.
    pub fn code(self) -> u32 {
        match self {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        }
    }
}

/// The element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
}

impl KvType {
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// The weight types the GPU backends run, by the suffix of their kernels (`matmul_q4_k`,
/// `embed_bf16`, ...: one naming for CUDA and Metal): GGUF's float and block types, and FP8
/// checkpoints' blocks. Outside the Metal module, which only macOS builds, so that the kernels'
/// tests on the CPU (crates/metal-on-cpu) run them all.
pub const GPU_WEIGHT_TYPES: [(GgmlType, &str); 10] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q6K, "q6_k"),
    (GgmlType::Fp8, "fp8"),
];

/// The kernel suffix of `ty` in the GPU backends, if they run it.
pub fn gpu_kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    GPU_WEIGHT_TYPES.iter().find(|(t, _)| *t == ty).map(|(_, s)| *s)
}

/// Head counts and sizes for the attention ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Where each token of a step keeps its keys and values in the paged KV cache.
///
/// A layer's K (and V) cache is `n_pages * page_size` rows of `kv_width`. A sequence owns a list
/// of pages, its row of `block_tables`; its token at position `p` lives in cache row
/// `table[p / page_size] * page_size + p % page_size`. Tokens of several sequences can share a
/// step: `token_seqs` says whose table each one uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKv {
    /// u32 `[n_seqs, table_width]`: page ids of each sequence, in position order.
    pub block_tables: BlockHandle,
    pub table_width: usize,
    /// u32 per token: its row of `block_tables`.
    pub token_seqs: BlockHandle,
    /// Tokens per page.
    pub page_size: usize,
}

/// A weight tensor as read from a model file, before it is handed to a backend.
pub struct HostTensor<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    /// GGML order: `dims[0]` is the row length.
    pub dims: &'a [usize],
    pub bytes: &'a [u8],
    /// The memory map the bytes live in, for backends that read weights in place.
    pub region: Option<(std::sync::Arc<memmap2::Mmap>, std::ops::Range<usize>)>,
}

impl HostTensor<'_> {
    /// `(n_in, n_out)` of a matrix (a vector counts as one row).
    pub fn matrix_shape(&self) -> Result<(usize, usize)> {
        match *self.dims {
            [n_in, n_out] => Ok((n_in, n_out)),
            [n_in] => Ok((n_in, 1)),
            _ => Err(crate::Error::Model(format!(
                "tensor {} has shape {:?}, expected a matrix",
                self.name, self.dims
            ))),
        }
    }
}

/// The activations a matmul reads: rows as they are, or rows RMS-normalized on the way in (the
/// norm before each attention and feed-forward block, which a backend may fold into the matmul).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Input {
    Rows(BlockHandle),
    /// `x[t] / rms(x[t]) * weight`, as `Kernels::rms_norm` computes it. A backend that does not
    /// normalize as it reads writes the normalized rows to `scratch` first.
    RmsNormed {
        x: BlockHandle,
        weight: BlockHandle,
        eps: f32,
        scratch: BlockHandle,
    },
}

impl From<BlockHandle> for Input {
    fn from(rows: BlockHandle) -> Input {
        Input::Rows(rows)
    }
}

/// The host's description of a step, as the model packed it into the step inputs: each token's
/// position and sequence row (`token_seqs` of [`PagedKv`]). A backend plans its attention from it
/// (`Kernels::plan_step`) instead of reading back what the host wrote.
#[derive(Debug, Clone, Copy)]
pub struct StepLayout<'a> {
    pub positions: &'a [u32],
    pub token_seqs: &'a [u32],
}

impl StepLayout<'_> {
    pub fn n_tokens(&self) -> usize {
        self.positions.len()
    }
}

/// How a layer's attention weighs what it sees. Token t at position `pos` attends to positions
/// `pos - window + 1 ..= pos` of its sequence (all of `0..=pos` without a window), with scores
/// `scale * q.k`, capped to `softcap * tanh(s / softcap)` where set (Gemma 2), then softmaxed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
}

impl Scores {
    /// Plain causal attention over every earlier position, scaled by `1/sqrt(head_dim)`.
    pub fn causal(head_dim: usize) -> Scores {
        Scores {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// The first position a token at `pos` sees.
    pub fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// The rule as the GPU kernels take it, or an error naming a rule that weighs nothing.
    pub fn kernel_args(&self) -> crate::Result<ScoreArgs> {
        if !self.scale.is_finite() {
            return Err(crate::Error::Backend(format!("attention scale {}", self.scale)));
        }
        let softcap = match self.softcap {
            Some(cap) if cap.is_finite() && cap > 0.0 => cap,
            Some(cap) => {
                return Err(crate::Error::Backend(format!(
                    "attention soft cap {cap}: not a positive number"
                )))
            }
            None => 0.0,
        };
        let window = match self.window {
            Some(0) => {
                return Err(crate::Error::Backend(
                    "an attention window of 0 positions sees nothing".into(),
                ))
            }
            // Positions stay below 2^31: a wider window sees every earlier one.
            Some(w) => i32::try_from(w).unwrap_or(0),
            None => 0,
        };
        Ok(ScoreArgs {
            scale: self.scale,
            softcap,
            window,
        })
    }

    /// A raw score `q.k` as the softmax takes it.
    pub fn apply(&self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }
}

/// [`Scores`] as the GPU kernels take them: the scale, the cap (0: none) and the window (0: every
/// earlier position).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreArgs {
    pub scale: f32,
    pub softcap: f32,
    pub window: i32,
}

/// What attention reads besides the queries: a layer's paged caches, the step's positions and
/// pages, how the layer scores them, and the backend's plan of the step (`Kernels::plan_step`).
#[derive(Debug)]
pub struct AttentionKv<'a, P> {
    pub k_cache: BlockHandle,
    pub v_cache: BlockHandle,
    pub positions: BlockHandle,
    pub pages: PagedKv,
    pub scores: Scores,
    pub plan: &'a P,
}

// By hand: derived, they would ask for `P: Clone` of a plan only ever borrowed.
impl<P> Clone for AttentionKv<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for AttentionKv<'_, P> {}

/// Where a greedy choice (`Kernels::queue_argmax`) leaves the next step's one input token on the
/// device: its id in `token`, and in `position` the position after `chosen_at`'s (the position of
/// the row it was chosen from; one u32 each, and `position` may be `chosen_at`). The next step
/// then needs nothing from the host until its sequence takes a new page.
#[derive(Debug, Clone, Copy)]
pub struct NextInput {
    pub token: BlockHandle,
    pub chosen_at: BlockHandle,
    pub position: BlockHandle,
}

/// The shape of a backend's weight matrix, `[n_out, n_in]`.
pub trait Matrix {
    fn n_in(&self) -> usize;
    fn n_out(&self) -> usize;
}

/// `Matrix` for a weight type with `n_in` and `n_out` fields (each backend's).
macro_rules! impl_matrix {
    ($weight:ty) => {
        impl $crate::backend::Matrix for $weight {
            fn n_in(&self) -> usize {
                self.n_in
            }
            fn n_out(&self) -> usize {
                self.n_out
            }
        }
    };
}
use impl_matrix;
