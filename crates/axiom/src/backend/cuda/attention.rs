//! Attention over the paged KV cache: the one-pass kernel (kernels/attention.cu) for steps of
//! few tokens, the choice between it and flash attention, and the output projection after it.

use super::gemm::{gemm_input, GemmOutput, Staged};
use super::launch::page_size_arg;
use super::matmul::{interleaves_activations, starts_next_early, Epilogue, GemvPlan, MatmulPlan, Quantized};
use super::params::AttentionParams;
use super::rope::rope_args;
use super::weights::CudaWeight;
use super::{CudaBackend, FlashPlan};
use crate::backend::{
    rope_attend_and_project_in_steps, AttentionKv, AttentionShape, Backend, BlockHandle, NewRows, Projection, Rope,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// Threads of the one-pass attention kernel (ATTN_THREADS in attention.cu).
const ATTENTION_THREADS: u32 = 256;

/// The most blocks of the one-pass kernel that share a head's context (ATTN_MAX_SPLITS).
const ATTENTION_MAX_SPLITS: usize = 8;

/// The largest head the attention kernels take.
pub(super) const ATTENTION_MAX_HEAD_DIM: usize = 256;

impl CudaBackend {
    /// `Kernels::attention`; with `quantized_for`, the one-pass kernel also writes its output into
    /// that staging as `quantize_activations` would for that weight (the head size then a multiple
    /// of 32). With `new`, a step of one token also rotates the query and the new key and stores
    /// the token's cache row, as `rope_kv_write` would before it; a flash-attention step rotates
    /// its queries, whose keys `rotate_and_store` has stored with their angles.
    pub(super) fn attend(
        &self,
        q: BlockHandle,
        new: Option<NewRows>,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        out: BlockHandle,
        quantized_for: Option<((BlockHandle, BlockHandle), &CudaWeight)>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        if shape.head_dim > ATTENTION_MAX_HEAD_DIM || !shape.head_dim.is_multiple_of(8) {
            return Err(Error::Backend(format!(
                "head dimension {}: the CUDA attention kernels take multiples of 8 up to {ATTENTION_MAX_HEAD_DIM}",
                shape.head_dim
            )));
        }
        if self.takes_flash(shape, n_tokens) {
            let rotate = new.map(|new| new.rope);
            return self.flash_attention(q, rotate, kv, self.ptr(out), GgmlType::F32, n_tokens, shape);
        }
        let (k_new, v_new, freqs, (dims, halves, scale)) = match new {
            Some(new) => (
                self.ptr(new.k),
                self.ptr(new.v),
                self.ptr(new.freqs),
                rope_args(new.rope)?,
            ),
            None => (0, 0, 0, (0, 0, 1.0)),
        };
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores,
            ..
        } = kv;
        let scores = scores.kernel_args()?;
        let page_size = page_size_arg(&pages)?;
        let n = n_tokens * shape.q_width();
        let (xq, xd, interleave, start_next) = match quantized_for {
            Some(((xq, _), _)) if n > xq.len => {
                return Err(Error::Backend(format!(
                    "{n} outputs exceed the int8 staging of {}",
                    xq.len
                )))
            }
            Some(((xq, xd), w)) => (
                self.ptr(xq),
                self.ptr(xd),
                i32::from(interleaves_activations(w.ty)),
                i32::from(starts_next_early(w.ty)),
            ),
            None => (0, 0, 0, 0),
        };
        // Where the step's heads leave multiprocessors idle, several blocks may share each head's
        // context (heads times splits at most the multiprocessors: their states fit past the
        // arena).
        let heads = n_tokens * shape.n_heads;
        let splits = self
            .paths
            .attention_splits(self.device.multiprocessors as usize, heads, ATTENTION_MAX_SPLITS);
        self.launch(
            &format!("attention_{}", self.kv_suffix()),
            (n_tokens as u32, shape.n_heads as u32, splits as u32),
            ATTENTION_THREADS,
            &AttentionParams {
                q: self.ptr(q),
                k_cache: self.ptr(k_cache),
                v_cache: self.ptr(v_cache),
                positions: self.ptr(positions),
                tables: self.ptr(pages.block_tables),
                table_width: pages.table_width as i32,
                token_seqs: self.ptr(pages.token_seqs),
                page_size,
                k_new,
                v_new,
                freqs,
                dims,
                halves,
                rope_scale: scale,
                out: self.ptr(out),
                xq,
                xd,
                interleave,
                start_next,
                partials: self.attention_partials,
                n_heads: shape.n_heads as i32,
                n_kv_heads: shape.n_kv_heads as i32,
                head_dim: shape.head_dim as i32,
                scale: scores.scale,
                softcap: scores.softcap,
                window: scores.window,
            },
        )
    }

    /// Where the output projection runs on integers (decode of a quantized `wo`), the one-pass
    /// attention kernel quantizes its output for it as it writes it: no launch of its own. Where
    /// it runs through cuBLAS after flash attention (prefill), attention writes its 16-bit input.
    /// `new` as for `attend`.
    pub(super) fn attend_then_project(
        &self,
        q: BlockHandle,
        new: Option<NewRows>,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        proj: Projection<'_, CudaWeight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let Projection {
            wo,
            attn: out,
            residual,
        } = proj;
        match self.projection_plan(wo, n_tokens, shape) {
            ProjectionPlan::Flash16(input) => {
                // Flash attention writes its output in the 16-bit type cuBLAS reads, straight into
                // the staging: no f32 round trip and no conversion pass.
                let (_, x_stage) = self.cublas_staging()?;
                let n = n_tokens * shape.q_width();
                if n * 2 > x_stage.len {
                    return Err(Error::Backend(format!(
                        "{n} attention outputs exceed the cuBLAS staging of {} bytes",
                        x_stage.len
                    )));
                }
                let rotate = new.map(|new| new.rope);
                self.flash_attention(q, rotate, kv, self.ptr(x_stage), input, n_tokens, shape)?;
                self.gemm(
                    out,
                    wo,
                    residual.stream,
                    n_tokens,
                    GemmOutput::Add,
                    &mut Staged::sixteen(input),
                )
            }
            ProjectionPlan::Folded(staging) => {
                self.attend(q, new, kv, out, Some((staging, wo)), n_tokens, shape)?;
                let (xq, xd) = staging;
                let quantized = Quantized {
                    xq,
                    xd,
                    interleaved: interleaves_activations(wo.ty),
                    by_quiet_kernel: n_tokens == 1,
                };
                // The activations are already quantized: nothing is left to normalize.
                let plan = GemvPlan::Int8 {
                    staging,
                    normalizes: false,
                };
                self.gemv(
                    out.into(),
                    &[wo],
                    &[residual.stream],
                    n_tokens,
                    plan,
                    Epilogue::Add,
                    &mut Some(quantized),
                )
            }
            ProjectionPlan::Separate => {
                self.attend(q, new, kv, out, None, n_tokens, shape)?;
                self.matmul_add(out, wo, residual, n_tokens)
            }
        }
    }

    /// How `attend_then_project` runs attention and the projection after it: flash attention
    /// into cuBLAS's 16-bit staging where both take the step; the one-pass kernel quantizing its
    /// output where the projection runs on integers (its blocks of 32 then within a head); else
    /// attention, then `matmul_add` on its f32 output.
    fn projection_plan(&self, wo: &CudaWeight, n_tokens: usize, shape: AttentionShape) -> ProjectionPlan {
        let input = gemm_input(wo.ty);
        match (self.takes_flash(shape, n_tokens), self.matmul_plan(wo, n_tokens)) {
            (true, MatmulPlan::Gemm) if input != GgmlType::F32 => ProjectionPlan::Flash16(input),
            (false, MatmulPlan::Gemv(GemvPlan::Int8 { staging, .. })) if shape.head_dim.is_multiple_of(32) => {
                ProjectionPlan::Folded(staging)
            }
            _ => ProjectionPlan::Separate,
        }
    }

    /// How `rope_attend_then_project` rotates and stores the step's new rows: before flash
    /// attention, which rotates the queries as it loads them, where it takes the step and rotates
    /// whole heads; in the one-pass kernel, for a step of one token where the paths allow; else
    /// in steps.
    fn rope_plan(&self, rope: Rope, n_tokens: usize, shape: AttentionShape) -> RopePlan {
        if self.takes_flash(shape, n_tokens) && rope.dims == shape.head_dim {
            RopePlan::KeysBeforeFlash
        } else if n_tokens == 1 && self.paths.rope_in_attention() {
            RopePlan::InAttention
        } else {
            RopePlan::InSteps
        }
    }

    /// In a step of one token, the attention kernel rotates the query and the key and stores the
    /// token's cache row itself: no rope_kv_write launch, and one kernel boundary less a layer.
    /// Steps of more tokens rotate and store the keys first (their tokens read each other's rows);
    /// in flash-attention steps that rotate whole heads, flash attention rotates the queries as it
    /// loads them.
    pub(super) fn rope_attend_then_project(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        proj: Projection<'_, CudaWeight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        match self.rope_plan(new.rope, n_tokens, shape) {
            RopePlan::KeysBeforeFlash => self.rotate_and_store(new, kv, n_tokens, shape, self.flash_turns)?,
            RopePlan::InAttention => {}
            RopePlan::InSteps => return rope_attend_and_project_in_steps(self, new, kv, proj, n_tokens, shape),
        }
        self.attend_then_project(new.q, Some(new), kv, proj, n_tokens, shape)
    }
}

/// How attention and the output projection after it run (`projection_plan`): flash attention
/// writing the 16-bit type cuBLAS reads; the one-pass kernel quantizing its output into `staging`
/// for the integer matrix-vector kernels; or attention, then `matmul_add`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ProjectionPlan {
    Flash16(GgmlType),
    Folded((BlockHandle, BlockHandle)),
    Separate,
}

/// Where a step's new rows are rotated and stored (`rope_plan`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RopePlan {
    KeysBeforeFlash,
    InAttention,
    InSteps,
}
