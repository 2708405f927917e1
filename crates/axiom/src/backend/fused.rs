//! [`Backend`]: the model-level ops the layer loop calls, each with a default composition of
//! [`Kernels`] primitives (the `*_in_steps` functions) that a backend replaces where it fuses
//! them; and the small structs they take.

use super::{
    Activation, AttentionKv, AttentionShape, BlockHandle, ExpertScratch, ExpertSet, Input, Kernels, Matrix, Rope,
    Routes, Routing,
};
use crate::Result;

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

/// A product added to the residual stream `stream`; `scratch` holds the product (rows of the
/// stream's width) for a backend that adds it in a second step.
#[derive(Debug, Clone, Copy)]
pub struct Residual {
    pub stream: BlockHandle,
    pub scratch: BlockHandle,
}

/// The attention block's output projection: attention writes its rows to `attn`, and their
/// product with `wo` is added to `residual`.
pub struct Projection<'a, W> {
    pub wo: &'a W,
    pub attn: BlockHandle,
    pub residual: Residual,
}

// By hand: derived, they would ask for `W: Clone` of a weight only ever borrowed.
impl<W> Clone for Projection<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for Projection<'_, W> {}

/// A feed-forward block's three matrices and its gate's activation.
pub struct FeedForward<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
    pub activation: Activation,
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

impl FeedForwardScratch {
    /// Where `gate_up_glu` writes: `hidden`, with `gate` and `up` as its scratch.
    pub fn glu(&self) -> GluRows {
        GluRows {
            gate: self.gate,
            up: self.up,
            out: self.hidden,
        }
    }
}

/// Where `gate_up_glu` writes `out`; `gate` and `up` hold the two products for a backend that
/// takes it in steps. All rows of the block's width.
#[derive(Debug, Clone, Copy)]
pub struct GluRows {
    pub gate: BlockHandle,
    pub up: BlockHandle,
    pub out: BlockHandle,
}

/// A mixture-of-experts feed-forward block: the router's matrix (`[n_experts, dim]`), how tokens
/// choose by its logits, the experts, and a shared expert where the model has one.
pub struct Mixture<'a, W> {
    pub router: &'a W,
    pub routing: Routing,
    pub experts: ExpertSet<'a, W>,
    pub shared: Option<SharedExpert<'a, W>>,
}

/// An expert every token runs (Qwen2-MoE), its output scaled by `sigmoid(x gate^T)` (`gate` is
/// `[1, dim]`).
pub struct SharedExpert<'a, W> {
    pub ffn: FeedForward<'a, W>,
    pub gate: &'a W,
}

/// Scratch for a mixture block of `n_tokens`: the router's `logits` (`[n_tokens, n_experts]`),
/// the `routes` it chooses, the expert op's rows, the shared expert's feed-forward rows and its
/// gate logits (one per token).
#[derive(Debug, Clone, Copy)]
pub struct MixtureScratch {
    pub logits: BlockHandle,
    pub routes: Routes,
    pub experts: ExpertScratch,
    pub shared: FeedForwardScratch,
    pub shared_gates: BlockHandle,
}

/// `Backend::mixture` in steps: the input rows, the router's `matmul`, `route`, `experts`
/// added to the residual stream, then the shared expert's feed-forward block and `add_gated`.
pub fn mixture_in_steps<B: Backend + ?Sized>(
    b: &B,
    x: Input,
    m: Mixture<'_, B::Weight>,
    s: MixtureScratch,
    residual: BlockHandle,
    n_tokens: usize,
) -> Result<()> {
    let dim = m.router.n_in();
    let rows = b.input_rows(x, n_tokens, dim)?;
    b.matmul(rows, m.router, s.logits, n_tokens)?;
    b.route(s.logits, s.routes, n_tokens, m.routing)?;
    b.experts(rows, m.experts, s.routes, s.experts, residual, n_tokens)?;
    match m.shared {
        Some(shared) => add_shared_expert(b, rows, shared, s, residual, n_tokens),
        None => Ok(()),
    }
}

/// A mixture block's shared expert over its input `rows`: the feed-forward block, gated by
/// `sigmoid(rows gate^T)` into `residual` (`add_gated`).
pub fn add_shared_expert<B: Backend + ?Sized>(
    b: &B,
    rows: BlockHandle,
    shared: SharedExpert<'_, B::Weight>,
    s: MixtureScratch,
    residual: BlockHandle,
    n_tokens: usize,
) -> Result<()> {
    let ffn = shared.ffn;
    b.gate_up_glu(
        rows.into(),
        [ffn.gate, ffn.up],
        s.shared.glu(),
        n_tokens,
        ffn.activation,
    )?;
    b.matmul(s.shared.hidden, ffn.down, s.shared.proj, n_tokens)?;
    b.matmul(rows, shared.gate, s.shared_gates, n_tokens)?;
    b.add_gated(residual, s.shared.proj, s.shared_gates, n_tokens, ffn.down.n_out())
}

/// `Backend::rope_kv_write` in three steps: `rope` on the queries, on the keys, then `kv_write`.
pub fn rope_kv_write_in_steps<B: Backend + ?Sized>(
    b: &B,
    new: NewRows,
    kv: AttentionKv<'_, B::StepPlan>,
    n_tokens: usize,
    shape: AttentionShape,
) -> Result<()> {
    let NewRows { q, k, v, freqs, rope } = new;
    b.rope(q, kv.positions, freqs, n_tokens, shape.n_heads, shape.head_dim, rope)?;
    b.rope(k, kv.positions, freqs, n_tokens, shape.n_kv_heads, shape.head_dim, rope)?;
    b.kv_write(k, v, kv, n_tokens, shape.kv_width())
}

/// `Backend::rope_attend_and_project` in two steps: `rope_kv_write`, then `attend_and_project`.
pub fn rope_attend_and_project_in_steps<B: Backend + ?Sized>(
    b: &B,
    new: NewRows,
    kv: AttentionKv<'_, B::StepPlan>,
    proj: Projection<'_, B::Weight>,
    n_tokens: usize,
    shape: AttentionShape,
) -> Result<()> {
    b.rope_kv_write(new, kv, n_tokens, shape)?;
    b.attend_and_project(new.q, kv, proj, n_tokens, shape)
}

/// `Backend::attend_and_project` in two steps: `attention` into `proj.attn`, then `matmul_add`.
pub fn attend_and_project_in_steps<B: Backend + ?Sized>(
    b: &B,
    q: BlockHandle,
    kv: AttentionKv<'_, B::StepPlan>,
    proj: Projection<'_, B::Weight>,
    n_tokens: usize,
    shape: AttentionShape,
) -> Result<()> {
    b.attention(q, kv, proj.attn, n_tokens, shape)?;
    b.matmul_add(proj.attn, proj.wo, proj.residual, n_tokens)
}

/// `Backend::gate_up_glu` in two steps: `matmul_many` into the scratch, then `glu`.
pub fn gate_up_glu_in_steps<B: Backend + ?Sized>(
    b: &B,
    x: Input,
    [w_gate, w_up]: [&B::Weight; 2],
    rows: GluRows,
    n_tokens: usize,
    act: Activation,
) -> Result<()> {
    b.matmul_many(x, &[w_gate, w_up], &[rows.gate, rows.up], n_tokens)?;
    b.glu(rows.gate, rows.up, rows.out, n_tokens * w_gate.n_out(), act)
}

/// `Backend::feed_forward` in two steps: `gate_up_glu` into `scratch.hidden`, then `matmul_add`.
pub fn feed_forward_in_steps<B: Backend + ?Sized>(
    b: &B,
    x: Input,
    ffn: FeedForward<'_, B::Weight>,
    s: FeedForwardScratch,
    residual: BlockHandle,
    n_tokens: usize,
) -> Result<()> {
    b.gate_up_glu(x, [ffn.gate, ffn.up], s.glu(), n_tokens, ffn.activation)?;
    let residual = Residual {
        stream: residual,
        scratch: s.proj,
    };
    b.matmul_add(s.hidden, ffn.down, residual, n_tokens)
}

/// The ops of the model's layer loop above the primitives. Each has a default composition of
/// simpler ops; a backend overrides those it runs fused.
pub trait Backend: Kernels {
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
    /// `matmul` of one input by several weights (Q/K/V, gate/up): a backend can prepare the input
    /// once. The default takes the input's rows (see `input_rows`) and runs them one by one.
    fn matmul_many(&self, x: Input, ws: &[&Self::Weight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        let x = self.input_rows(x, n_tokens, ws.first().map_or(0, |w| w.n_in()))?;
        for (w, &out) in ws.iter().zip(outs) {
            self.matmul(x, w, out, n_tokens)?;
        }
        Ok(())
    }
    /// `residual.stream[t] += x[t] w^T`. The default writes the product to `residual.scratch`
    /// and adds it.
    fn matmul_add(&self, x: BlockHandle, w: &Self::Weight, residual: Residual, n_tokens: usize) -> Result<()> {
        self.matmul(x, w, residual.scratch, n_tokens)?;
        self.add(residual.stream, residual.scratch, n_tokens * w.n_out())
    }
    /// The feed-forward block's first half, `rows.out = act(x w_gate^T) * (x w_up^T)` for
    /// `n_tokens` rows; the default is `gate_up_glu_in_steps`.
    fn gate_up_glu(
        &self,
        x: Input,
        ws: [&Self::Weight; 2],
        rows: GluRows,
        n_tokens: usize,
        act: Activation,
    ) -> Result<()> {
        gate_up_glu_in_steps(self, x, ws, rows, n_tokens, act)
    }
    /// The whole feed-forward block added to the residual stream: `residual += h w_down^T` with
    /// `h = act(x w_gate^T) * (x w_up^T)`, for `n_tokens` rows. A backend may keep `h` in a form
    /// of its own between the two halves; the default, `feed_forward_in_steps`, writes it to
    /// `scratch.hidden` with `gate_up_glu` and then runs `matmul_add`.
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
    /// A mixture-of-experts feed-forward block added to the residual stream: each token's
    /// chosen experts weighed by the router, plus the gated shared expert where there is one.
    /// The default is `mixture_in_steps`.
    fn mixture(
        &self,
        x: Input,
        m: Mixture<'_, Self::Weight>,
        scratch: MixtureScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        mixture_in_steps(self, x, m, scratch, residual, n_tokens)
    }
    /// Qwen3's norms of each query and key head before the rotation: `rms_norm` of the step's
    /// query heads `q` (rows of `shape.head_dim`) by `weights[0]` into `out[0]`, and of its key
    /// heads `k` by `weights[1]` into `out[1]`. The default is the two norms.
    fn head_norms(
        &self,
        [q, k]: [BlockHandle; 2],
        weights: [BlockHandle; 2],
        out: [BlockHandle; 2],
        n_tokens: usize,
        shape: AttentionShape,
        eps: f32,
    ) -> Result<()> {
        self.rms_norm(q, weights[0], out[0], n_tokens * shape.n_heads, shape.head_dim, eps)?;
        self.rms_norm(k, weights[1], out[1], n_tokens * shape.n_kv_heads, shape.head_dim, eps)
    }
    /// `rope` on the query and key heads of `new`, then `kv_write` of the rotated keys and the
    /// values: the start of a layer's attention in one op. The default is
    /// `rope_kv_write_in_steps`.
    fn rope_kv_write(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Self::StepPlan>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        rope_kv_write_in_steps(self, new, kv, n_tokens, shape)
    }
    /// The attention block's end: `attention` of `q` over the cache into `proj.attn`, then its
    /// product with `proj.wo` added to the residual stream. A backend may hand the attention's
    /// output to the projection in a form of its own; the default is
    /// `attend_and_project_in_steps`.
    fn attend_and_project(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Self::StepPlan>,
        proj: Projection<'_, Self::Weight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        attend_and_project_in_steps(self, q, kv, proj, n_tokens, shape)
    }
    /// A layer's attention block from its Q, K and V rows on: `rope_kv_write` of `new` into the
    /// caches, then `attend_and_project`. `new.q` and `new.k` are scratch, left rotated or not. A
    /// backend may rotate the rows and store them in the caches within attention; the default is
    /// `rope_attend_and_project_in_steps`.
    fn rope_attend_and_project(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Self::StepPlan>,
        proj: Projection<'_, Self::Weight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        rope_attend_and_project_in_steps(self, new, kv, proj, n_tokens, shape)
    }
}
