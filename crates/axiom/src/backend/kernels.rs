//! [`Kernels`]: what every backend must have. Its allocator and transfers, graph recording, the
//! greedy-choice protocol, and the primitive ops, each checked against the CPU reference
//! (tests/common/gpu.rs). The model-level ops built from them are [`super::Backend`]'s.

use super::{
    Activation, AttentionKv, AttentionShape, BlockHandle, ExpertScratch, ExpertSet, HostTensor, KvType, Matrix,
    NextInput, Rope, Routes, Routing, StepLayout,
};
use crate::Result;

/// `Kernels`'s greedy-choice methods for a backend whose work is done when its calls return (the
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
            self.argmax(x, next.token, 1, width, None)?;
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
pub(super) use choices_at_once;

pub trait Kernels {
    /// A weight matrix resident on the backend, in its stored type.
    type Weight: Matrix;
    /// Host memory for what `read_f32` brings back every step (the logits): page-locked on CUDA,
    /// where the copy then goes straight into it instead of through the driver's staging buffer.
    type HostF32: std::ops::DerefMut<Target = [f32]>;
    /// Host-visible memory a queued greedy choice is written to (see `queue_argmax`).
    type ChoiceSlot;
    /// What the backend works out once a step, from the step's layout, for its ops over the
    /// cache (they receive it in [`AttentionKv`]).
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
    /// Makes one matrix of every expert of a mixture-of-experts layer (all of one shape and
    /// type) available to `experts`.
    fn upload_experts(&mut self, tensors: &[HostTensor]) -> Result<Vec<Self::Weight>>;

    // --- context: host <-> device and ordering ---

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()>;
    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()>;
    fn read_f32(&self, src: BlockHandle, dst: &mut [f32]) -> Result<()>;
    /// `len` zeroed floats of host memory that `read_f32` fills fastest.
    fn host_f32(&self, len: usize) -> Result<Self::HostF32>;
    fn read_u32(&self, src: BlockHandle, dst: &mut [u32]) -> Result<()>;
    /// Waits until all submitted work has finished.
    fn synchronize(&self) -> Result<()>;
    /// Readies the calling thread for this backend's ops, where a backend ties state to threads
    /// (CUDA makes its context current there): a rank run on a thread of its own calls it first.
    fn enter_thread(&self) -> Result<()> {
        Ok(())
    }
    /// Starts or stops the device profiler's collection (`axiom bench --profile`), so that a
    /// profiler started with collection off records only what runs in between.
    fn profile(&self, _on: bool) -> Result<()> {
        Err(crate::Error::InvalidArgument(format!(
            "the {} backend has no profiler to start (--profile is for CUDA)",
            self.device_name()
        )))
    }

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

    // --- primitive ops ---

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
    /// Stores the K and V rows of `n_tokens` tokens in the paged caches of `kv` (rows of
    /// `kv_width` in `kv_type()`), each in its sequence's row for its position.
    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        kv: AttentionKv<'_, Self::StepPlan>,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()>;
    /// The plan of a step of `layout` for the ops of `shape` over the cache: called by the host
    /// once a step, after the step's inputs are written and outside any graph recording.
    fn plan_step(&self, layout: StepLayout, shape: AttentionShape) -> Result<Self::StepPlan>;
    /// Causal grouped-query attention over the paged caches: token t attends to the positions up
    /// to `positions[t]` of its own sequence that `kv.scores` lets it see, weighed as it says.
    fn attention(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Self::StepPlan>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()>;
    /// `x[t] += bias` for `n_tokens` rows of `width`.
    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()>;
    /// `out = act(gate) * up`, elementwise over `n` values.
    fn glu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize, act: Activation) -> Result<()>;
    /// `x += y`, elementwise over `n` values.
    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()>;
    /// `x *= factor`, elementwise over `n` values (Gemma's scaled embeddings).
    fn scale(&self, x: BlockHandle, factor: f32, n: usize) -> Result<()>;
    /// `x = cap * tanh(x / cap)`, elementwise over `n` values (Gemma 2's capped logits).
    fn softcap(&self, x: BlockHandle, cap: f32, n: usize) -> Result<()>;
    /// `out[r]` = the index of the largest value of row r of `x` (`n_rows` rows of `width`; the
    /// lowest index on ties, 0 where nothing is above -inf): greedy decoding without bringing
    /// the logits back. `allowed`, where given, holds each row's allowed indices as
    /// `width.div_ceil(32)` words (index i is bit i % 32 of word i / 32); the others count as
    /// -inf, so a constrained greedy choice needs no logits on the host either.
    fn argmax(
        &self,
        x: BlockHandle,
        out: BlockHandle,
        n_rows: usize,
        width: usize,
        allowed: Option<BlockHandle>,
    ) -> Result<()>;

    // --- mixture of experts: the choice stays on the device, between `route` and `experts` ---

    /// Each token's experts from its router logits (`[n_tokens, routing.n_experts]`), as
    /// [`Routing`] says, into `routes`.
    fn route(&self, logits: BlockHandle, routes: Routes, n_tokens: usize, routing: Routing) -> Result<()>;
    /// `residual[t] += sum_j weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t])` over each
    /// token's chosen experts `e = ids[t, j]` of `routes`, for `n_tokens` rows `x` of the model's
    /// width. An id outside the set is an error where the backend reads the ids on the host, NaN
    /// rows of `residual` where it leaves them on the device (Metal).
    fn experts(
        &self,
        x: BlockHandle,
        experts: ExpertSet<'_, Self::Weight>,
        routes: Routes,
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()>;
    /// `x[t] += sigmoid(gates[t]) * rows[t]` for `n_tokens` rows of `width` and one gate logit
    /// each (Qwen2-MoE's gated shared expert).
    fn add_gated(
        &self,
        x: BlockHandle,
        rows: BlockHandle,
        gates: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()>;

    // --- greedy choices the host reads a step later ---

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
