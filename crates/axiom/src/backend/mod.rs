//! The narrow interface every compute backend implements, and the backends themselves.
//!
//! A backend has four layers: a device (what it runs on), a context (the queue or
//! stream work is submitted to), an allocator (one arena reserved up front, handing out
//! [`BlockHandle`]s) and kernels (one per op). The model's layer loop is written once against
//! [`Backend`]; activations and the KV cache live in arena blocks, weights in whatever form the
//! backend keeps them (the CPU reads them straight from the memory-mapped file).
//!
//! Buffer conventions: activations are row-major f32 `[n_tokens, width]`; token ids and positions
//! are u32; a weight matrix `[n_out, n_in]` is stored row by row in its GGUF type, so
//! `matmul` computes `out[t, o] = sum_i x[t, i] * w[o, i]`.

pub mod arena;
pub mod cpu;
pub mod cuda;
#[cfg(any(target_vendor = "apple", axiom_metal_check))]
pub mod metal;

pub use arena::{Arena, ArenaError, BlockHandle};

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
    /// Number of leading dimensions of each head that are rotated (usually all of them).
    pub dims: usize,
    pub scaling: RopeScaling,
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
}

impl Rope {
    /// The angle per position of each rotated pair, `theta^(-2i/dims)` after scaling, as
    /// transformers computes it. The rope kernels read this table.
    pub fn inverse_frequencies(&self) -> Vec<f32> {
        (0..self.dims / 2)
            .map(|i| {
                let base = (self.theta as f64).powf(-2.0 * i as f64 / self.dims as f64);
                let f = match self.scaling {
                    RopeScaling::None => base,
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
                };
                f as f32
            })
            .collect()
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
/// `embed_bf16`, ...: one naming for CUDA and Metal).
pub const GPU_WEIGHT_TYPES: [(GgmlType, &str); 8] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q6K, "q6_k"),
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
    /// `x[t] / rms(x[t]) * weight`, as `Backend::rms_norm` computes it. A backend that does not
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
/// (`Backend::plan_step`) instead of reading back what the host wrote.
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

/// What attention reads besides the queries: a layer's paged caches, the step's positions and
/// pages, and the backend's plan of the step (`Backend::plan_step`).
#[derive(Debug)]
pub struct AttentionKv<'a, P> {
    pub k_cache: BlockHandle,
    pub v_cache: BlockHandle,
    pub positions: BlockHandle,
    pub pages: PagedKv,
    pub plan: &'a P,
}

// By hand: derived, they would ask for `P: Clone` of a plan only ever borrowed.
impl<P> Clone for AttentionKv<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for AttentionKv<'_, P> {}

/// Where a greedy choice (`Backend::queue_argmax`) leaves the next step's one input token on the
/// device: its id in `token`, and in `position` the position after `chosen_at`'s (the position of
/// the row it was chosen from; one u32 each, and `position` may be `chosen_at`). The next step
/// then needs nothing from the host until its sequence takes a new page.
#[derive(Debug, Clone, Copy)]
pub struct NextInput {
    pub token: BlockHandle,
    pub chosen_at: BlockHandle,
    pub position: BlockHandle,
}

/// A step's new query, key and value rows as the Q, K and V products wrote them (before RoPE),
/// and what rotates them: `freqs` holds `rope.dims / 2` inverse frequencies (f32).
#[derive(Debug, Clone, Copy)]
pub struct NewRows {
    pub q: BlockHandle,
    pub k: BlockHandle,
    pub v: BlockHandle,
    pub freqs: BlockHandle,
    pub rope: Rope,
}

/// `Backend::rope_attend_and_project` in two steps: `rope_kv_write`, then `attend_and_project`.
pub fn rope_attend_and_project_in_steps<B: Backend + ?Sized>(
    b: &B,
    new: NewRows,
    kv: AttentionKv<'_, B::StepPlan>,
    wo: &B::Weight,
    buffers: [BlockHandle; 3],
    n_tokens: usize,
    shape: AttentionShape,
) -> Result<()> {
    let NewRows { q, k, v, freqs, rope } = new;
    b.rope_kv_write(
        q,
        k,
        v,
        kv.k_cache,
        kv.v_cache,
        kv.positions,
        freqs,
        kv.pages,
        n_tokens,
        shape,
        rope,
    )?;
    b.attend_and_project(q, kv, wo, buffers, n_tokens, shape)
}

/// `Backend::attend_and_project` in two steps: `attention` into `out`, then `matmul_add`.
pub fn attend_and_project_in_steps<B: Backend + ?Sized>(
    b: &B,
    q: BlockHandle,
    kv: AttentionKv<'_, B::StepPlan>,
    wo: &B::Weight,
    [out, residual, scratch]: [BlockHandle; 3],
    n_tokens: usize,
    shape: AttentionShape,
) -> Result<()> {
    b.attention(q, kv, out, n_tokens, shape)?;
    b.matmul_add(out, wo, residual, scratch, n_tokens)
}

/// A feed-forward block's three matrices.
pub struct FeedForward<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
}

/// Scratch for a feed-forward block of `n_tokens`: `gate`, `up` and `hidden` hold rows of the
/// block's width, `proj` rows of the model's.
#[derive(Debug, Clone, Copy)]
pub struct FeedForwardScratch {
    pub gate: BlockHandle,
    pub up: BlockHandle,
    pub hidden: BlockHandle,
    pub proj: BlockHandle,
}

/// `Backend::gate_up_swiglu` in two steps: `matmul_many` into the scratch, then `swiglu`.
pub fn gate_up_swiglu_in_steps<B: Backend + ?Sized>(
    b: &B,
    x: Input,
    [w_gate, w_up]: [&B::Weight; 2],
    [gate, up]: [BlockHandle; 2],
    out: BlockHandle,
    n_tokens: usize,
    ffn_dim: usize,
) -> Result<()> {
    b.matmul_many(x, &[w_gate, w_up], &[gate, up], n_tokens)?;
    b.swiglu(gate, up, out, n_tokens * ffn_dim)
}

/// `Backend::feed_forward` in two steps: `gate_up_swiglu` into `scratch.hidden`, then `matmul_add`.
pub fn feed_forward_in_steps<B: Backend + ?Sized>(
    b: &B,
    x: Input,
    ffn: FeedForward<'_, B::Weight>,
    s: FeedForwardScratch,
    residual: BlockHandle,
    n_tokens: usize,
) -> Result<()> {
    let ffn_dim = ffn.gate.n_out();
    b.gate_up_swiglu(x, ffn.gate, ffn.up, [s.gate, s.up], s.hidden, n_tokens, ffn_dim)?;
    b.matmul_add(s.hidden, ffn.down, residual, s.proj, n_tokens)
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

/// `Backend`'s greedy-choice methods for a backend whose work is done when its calls return (the
/// CPU computes as work is submitted; Metal waits here): the argmax, the next position written
/// through the host, and the choice kept in the slot, a `Cell<u32>`.
macro_rules! choices_at_once {
    () => {
        fn choice_slot(&self) -> $crate::Result<::std::cell::Cell<u32>> {
            Ok(::std::cell::Cell::new(0))
        }

        fn queue_argmax(
            &self,
            x: $crate::backend::BlockHandle,
            next: $crate::backend::NextInput,
            width: usize,
            slot: &::std::cell::Cell<u32>,
        ) -> $crate::Result<()> {
            self.argmax(x, next.token, 1, width)?;
            let (mut position, mut chosen) = ([0], [0]);
            self.read_u32(next.chosen_at, &mut position)?;
            self.write_u32(next.position, &[position[0] + 1])?;
            self.read_u32(next.token, &mut chosen)?;
            slot.set(chosen[0]);
            Ok(())
        }

        fn mark_choice(&self, _: &::std::cell::Cell<u32>) -> $crate::Result<()> {
            Ok(())
        }

        fn wait_choice(&self, slot: &::std::cell::Cell<u32>) -> $crate::Result<u32> {
            Ok(slot.get())
        }
    };
}
use choices_at_once;

pub trait Backend {
    /// A weight matrix resident on the backend, in its stored type.
    type Weight: Matrix;
    /// Host memory for what `read_f32` brings back every step (the logits): page-locked on CUDA,
    /// where the copy then goes straight into it instead of through the driver's staging buffer.
    type HostF32: std::ops::DerefMut<Target = [f32]>;
    /// Host-visible memory a queued greedy choice is written to (see `queue_argmax`).
    type ChoiceSlot;
    /// What the backend works out once a step, from the step's layout, for its attention ops
    /// (they receive it in [`AttentionKv`]).
    type StepPlan;

    /// What the backend runs on, for logs and `axiom bench`.
    fn device_name(&self) -> String;

    /// Host threads the backend computes with (1 for a GPU).
    fn threads(&self) -> usize {
        1
    }

    /// The element type `kv_write` stores and `attention` reads.
    fn kv_type(&self) -> KvType;

    // --- allocator ---

    /// Reserves the arena all later `alloc` calls carve from. Called once, at model load.
    fn reserve(&mut self, bytes: usize) -> Result<()>;
    /// A block of `bytes` bytes from the arena, 64-byte aligned. Contents are unspecified.
    fn alloc(&mut self, bytes: usize) -> Result<BlockHandle>;
    fn free(&mut self, block: BlockHandle) -> Result<()>;

    /// Makes a weight matrix (2-D, any supported type) available to `matmul` and `embed`.
    fn upload_weight(&mut self, tensor: &HostTensor) -> Result<Self::Weight>;

    // --- context: host <-> device and ordering ---

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()>;
    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()>;
    fn read_f32(&self, src: BlockHandle, dst: &mut [f32]) -> Result<()>;
    /// `len` zeroed floats of host memory that `read_f32` fills fastest.
    fn host_f32(&self, len: usize) -> Result<Self::HostF32>;
    fn read_u32(&self, src: BlockHandle, dst: &mut [u32]) -> Result<()>;
    /// Waits until all submitted work has finished.
    fn synchronize(&self) -> Result<()>;

    /// Arena bytes the weights take, given each matrix's size (0 where weights live elsewhere,
    /// as on the CPU, which reads them from the memory-mapped file).
    fn weight_bytes(&self, _matrices: &[usize]) -> usize {
        0
    }
    /// Arena bytes the backend wants for its own staging, given the largest weight (elements),
    /// the most tokens per step and the widest matmul input. Counted in before `reserve`.
    fn staging_bytes(&self, _largest_weight: usize, _max_tokens: usize, _max_n_in: usize) -> usize {
        0
    }
    /// Called once the weights are uploaded, to carve that staging out of the arena.
    fn prepare(&mut self, _max_tokens: usize, _max_n_in: usize) -> Result<()> {
        Ok(())
    }

    // --- graphs: record a sequence of ops once, replay it per decode step ---

    /// Starts recording the ops of a step of `n_tokens` that follow instead of running them;
    /// false if the backend records no such steps (then ops run as usual).
    fn begin_capture(&self, _n_tokens: usize) -> Result<bool> {
        Ok(false)
    }
    /// Ends a recording started by `begin_capture`, returning the graph's handle.
    fn end_capture(&self) -> Result<usize> {
        Err(crate::Error::Backend("this backend records no graphs".into()))
    }
    /// Runs a recorded graph.
    fn replay(&self, _graph: usize) -> Result<()> {
        Err(crate::Error::Backend("this backend records no graphs".into()))
    }

    // --- kernels ---

    /// `out[t] = dequantize(table row ids[t])` for `n_tokens` ids.
    fn embed(&self, table: &Self::Weight, ids: BlockHandle, out: BlockHandle, n_tokens: usize) -> Result<()>;
    /// `out[t] = x[t] / rms(x[t]) * weight`, rows of `dim`.
    fn rms_norm(
        &self,
        x: BlockHandle,
        weight: BlockHandle,
        out: BlockHandle,
        n_tokens: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `out[t, o] = sum_i x[t, i] * w[o, i]`.
    fn matmul(&self, x: BlockHandle, w: &Self::Weight, out: BlockHandle, n_tokens: usize) -> Result<()>;
    /// `matmul` of one input by several weights (Q/K/V, gate/up): a backend can prepare the input
    /// once. The default takes the input's rows (see `input_rows`) and runs them one by one.
    fn matmul_many(&self, x: Input, ws: &[&Self::Weight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        let x = self.input_rows(x, n_tokens, ws.first().map_or(0, |w| w.n_in()))?;
        for (w, &out) in ws.iter().zip(outs) {
            self.matmul(x, w, out, n_tokens)?;
        }
        Ok(())
    }
    /// `out[t] += x[t] w^T`: a product added to the residual stream `out`. `scratch` holds the
    /// product (`n_tokens` rows of `w`'s outputs) for a backend that adds it in a second step, as
    /// the default does.
    fn matmul_add(
        &self,
        x: BlockHandle,
        w: &Self::Weight,
        out: BlockHandle,
        scratch: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        self.matmul(x, w, scratch, n_tokens)?;
        self.add(out, scratch, n_tokens * w.n_out())
    }
    /// The feed-forward block's first half, `out = silu(x w_gate^T) * (x w_up^T)` (`n_tokens`
    /// rows of `ffn_dim`). `gate` and `up` are scratch of that size for a backend that takes it in
    /// steps, as `gate_up_swiglu_in_steps` does (the default).
    #[allow(clippy::too_many_arguments)]
    fn gate_up_swiglu(
        &self,
        x: Input,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        scratch: [BlockHandle; 2],
        out: BlockHandle,
        n_tokens: usize,
        ffn_dim: usize,
    ) -> Result<()> {
        gate_up_swiglu_in_steps(self, x, [w_gate, w_up], scratch, out, n_tokens, ffn_dim)
    }
    /// The whole feed-forward block added to the residual stream: `residual += h w_down^T` with
    /// `h = silu(x w_gate^T) * (x w_up^T)`, for `n_tokens` rows. A backend may keep `h` in a form
    /// of its own between the two halves; the default, `feed_forward_in_steps`, writes it to
    /// `scratch.hidden` with `gate_up_swiglu` and then runs `matmul_add`.
    fn feed_forward(
        &self,
        x: Input,
        ffn: FeedForward<'_, Self::Weight>,
        scratch: FeedForwardScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        feed_forward_in_steps(self, x, ffn, scratch, residual, n_tokens)
    }
    /// The rows `x` stands for (`n_tokens` of `dim`): normalized into its scratch first if it is
    /// `Input::RmsNormed`. For the ops that do not normalize as they read.
    fn input_rows(&self, x: Input, n_tokens: usize, dim: usize) -> Result<BlockHandle> {
        match x {
            Input::Rows(rows) => Ok(rows),
            Input::RmsNormed {
                x,
                weight,
                eps,
                scratch,
            } => {
                self.rms_norm(x, weight, scratch, n_tokens, dim, eps)?;
                Ok(scratch)
            }
        }
    }
    /// Rotates, in place, each head of `x` (`[n_tokens, n_heads * head_dim]`) by its token's
    /// position: pair i by `position * freqs[i]` (f32, `rope.dims / 2` of them).
    fn rope(
        &self,
        x: BlockHandle,
        positions: BlockHandle,
        freqs: BlockHandle,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<()>;
    /// Stores the K and V rows of `n_tokens` tokens in the paged caches (rows of `kv_width` in
    /// `kv_type()`), each in its sequence's row for its position.
    #[allow(clippy::too_many_arguments)]
    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        pages: PagedKv,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()>;
    /// `rope` on the query and key heads, then `kv_write` of the rotated keys and the values: the
    /// start of a layer's attention in one op. The default runs the three.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        q: BlockHandle,
        k: BlockHandle,
        v: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        freqs: BlockHandle,
        pages: PagedKv,
        n_tokens: usize,
        shape: AttentionShape,
        rope: Rope,
    ) -> Result<()> {
        self.rope(q, positions, freqs, n_tokens, shape.n_heads, shape.head_dim, rope)?;
        self.rope(k, positions, freqs, n_tokens, shape.n_kv_heads, shape.head_dim, rope)?;
        self.kv_write(k, v, k_cache, v_cache, positions, pages, n_tokens, shape.kv_width())
    }
    /// The plan of a step of `layout` for the attention ops of `shape`: called by the host once
    /// a step, after the step's inputs are written and outside any graph recording.
    fn plan_step(&self, layout: StepLayout, shape: AttentionShape) -> Result<Self::StepPlan>;
    /// Causal grouped-query attention over the paged caches: token t attends to positions
    /// `0..=positions[t]` of its own sequence.
    fn attention(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Self::StepPlan>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()>;
    /// The attention block's end: `attention` of `q` over the cache into `out`, then its product
    /// with `wo` added to the residual stream (`matmul_add`, with `scratch`). A backend may hand
    /// the attention's output to the projection in a form of its own; the default,
    /// `attend_and_project_in_steps`, runs the two.
    fn attend_and_project(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Self::StepPlan>,
        wo: &Self::Weight,
        [out, residual, scratch]: [BlockHandle; 3],
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        attend_and_project_in_steps(self, q, kv, wo, [out, residual, scratch], n_tokens, shape)
    }
    /// A layer's attention block from its Q, K and V rows on: `rope_kv_write` of `new` into the
    /// caches, then `attend_and_project`. `new.q` and `new.k` are scratch, left rotated or not. A
    /// backend may rotate the rows and store them in the caches within attention; the default,
    /// `rope_attend_and_project_in_steps`, runs the two.
    fn rope_attend_and_project(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Self::StepPlan>,
        wo: &Self::Weight,
        buffers: [BlockHandle; 3],
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        rope_attend_and_project_in_steps(self, new, kv, wo, buffers, n_tokens, shape)
    }
    /// `x[t] += bias` for `n_tokens` rows of `width`.
    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()>;
    /// `out = silu(gate) * up`, elementwise over `n` values.
    fn swiglu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize) -> Result<()>;
    /// `x += y`, elementwise over `n` values.
    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()>;
    /// `out[r]` = the index of the largest value of row r of `x` (`n_rows` rows of `width`; the
    /// lowest index on ties, 0 where nothing is above -inf): greedy decoding without bringing
    /// the logits back.
    fn argmax(&self, x: BlockHandle, out: BlockHandle, n_rows: usize, width: usize) -> Result<()>;
    /// A place for `queue_argmax` to leave a choice for the host.
    fn choice_slot(&self) -> Result<Self::ChoiceSlot>;
    /// `argmax` of one row left as the next step's input (`next`) and in `slot`, without the
    /// host waiting for it here, so that it can submit the next step first; it may be recorded
    /// in a graph, the slot with it. (A backend that computes as work is submitted, the CPU, has
    /// it at once.)
    fn queue_argmax(&self, x: BlockHandle, next: NextInput, width: usize, slot: &Self::ChoiceSlot) -> Result<()>;
    /// Marks the work submitted so far as what `wait_choice(slot)` waits for.
    fn mark_choice(&self, slot: &Self::ChoiceSlot) -> Result<()>;
    /// Waits for the work marked last for `slot` (not for what was submitted after it) and gives
    /// the choice it left there.
    fn wait_choice(&self, slot: &Self::ChoiceSlot) -> Result<u32>;
}
