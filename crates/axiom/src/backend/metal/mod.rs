//! The Metal backend (Apple Silicon), in the four layers every backend has: device, context,
//! allocator, kernels.
//!
//! [`device`] is the system's default GPU; [`context`] its one command queue, with the ops of a
//! forward pass encoded into one command buffer that `synchronize` commits and waits for;
//! [`allocator`] one shared MTLBuffer carved by the arena every backend shares (unified memory:
//! the host writes inputs and reads results through the same memory, no copies); [`kernels`]
//! every MSL kernel, compiled once at startup. Weights keep their stored blocks (GGUF's, or FP8
//! checkpoints') and every matmul reads them as stored.
//!
//! Built on macOS only. On Linux, CI type-checks this code against a patched objc2-metal
//! (scripts/metal_check.sh) and runs every kernel on the CPU through a C++ shim
//! (crates/metal-on-cpu); neither runs it on a GPU. See docs/metal.md.

pub mod allocator;
pub mod context;
pub mod device;
pub mod kernels;

use super::{
    gate_up_glu_in_steps, gpu_kernel_suffix, Activation, AttentionKv, AttentionShape, Backend, BlockHandle,
    ExpertScratch, ExpertSet, GluRows, HostTensor, Input, Kernels, KvType, NewRows, Residual, Rope, RopeLayout, Routes,
    Routing, ScoreArgs, StepLayout,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use allocator::MetalAllocator;
use context::MetalContext;
use device::MetalDevice;
use kernels::{Kernel, MetalKernels};
use objc2_metal::{MTLComputeCommandEncoder, MTLSize};
use std::cell::Cell;
use std::ptr::NonNull;

const ALIGN: usize = 256;
/// Scratch for the two-pass attention's score matrix (used for heads too wide for the fused kernel).
const SCORES_BYTES: usize = 16 << 20;
/// Simdgroups the fused attention kernel merges at most (ATTN_MAX_SIMDS in attention.metal).
const ATTENTION_MAX_SIMDS: usize = 8;
/// Head dimensions one lane of the fused attention kernel holds at most (ATTN_MAX_PER_LANE).
const ATTENTION_MAX_PER_LANE: usize = 8;
/// Tokens from which a matmul runs tiled (`matmul_tiled_*`) rather than a row at a time: where
/// decoding every weight once per token costs more than one padded tile of tokens does (the
/// argument is in docs/metal.md, "Choosing the matmul kernel").
const TILED_MIN_TOKENS: usize = 16;
/// Simdgroups of a tiled matmul's threadgroup, and its tile (TILE_SIMDS, TILE_O, TILE_T in
/// matmul_tiled.metal).
const TILE_SIMDS: usize = 4;
const TILE_O: usize = 64;
const TILE_T: usize = 32;
/// The lanes of a simdgroup matrix: the tiled kernels' 8x8 multiplies need 32.
const SIMDGROUP_MATRIX_LANES: usize = 32;
/// Steps where a sequence brings at least this many consecutive tokens (a prompt, or a chunk of
/// one) run the prompt attention (`flash_attention_*`): its tiles of 32 queries then share each
/// key and value row among half their rows or more, where the one-pass kernel reads it once a
/// query; its 8x8 products cost the same whatever a tile's rows, so with fewer (decode: one a
/// sequence) the padding would cost more than the reads it saves.
const FLASH_MIN_RUN: usize = 16;
/// The prompt attention's tile: queries, and simdgroups (FA_ROWS, FA_SIMDS in
/// flash_attention.metal); a kernel per class of head sizes, a head running in the first at least
/// its size.
const FLASH_ROWS: usize = 32;
const FLASH_SIMDS: usize = 4;
pub(crate) const FLASH_HEAD_CLASSES: [usize; 3] = [64, 128, 256];

/// What can go wrong in the Metal layers, each naming the problem.
#[derive(Debug, thiserror::Error)]
pub enum MetalError {
    #[error("no Metal device")]
    NoDevice,
    #[error("compiling the Metal kernels: {0}")]
    LibraryCompilation(String),
    #[error("the Metal library has no kernel function {0:?}")]
    MissingFunction(String),
    #[error("creating the Metal pipeline of {name}: {message}")]
    PipelineCreation { name: String, message: String },
    #[error("a Metal command buffer ended with status {status}: {error}")]
    CommandBuffer { status: u64, error: String },
    #[error("a Metal buffer of {bytes} bytes is over the device's limit of {max}")]
    BufferTooLarge { bytes: usize, max: usize },
    #[error("Metal: {0}")]
    Internal(&'static str),
}

/// A weight matrix in the shared buffer, in its stored blocks.
pub struct MetalWeight {
    pub ty: GgmlType,
    pub n_out: usize,
    pub n_in: usize,
    block: BlockHandle,
}
super::impl_matrix!(MetalWeight);

/// The plan of a step (`Backend::plan_step`): the longest context a token of it attends to,
/// which the two-pass attention's score rows span, and whether it runs the prompt attention.
#[derive(Debug, Clone, Copy)]
pub struct StepContext {
    n_ctx: usize,
    prompt: bool,
}

/// A kernel argument: an arena block bound as a buffer, or a scalar copied into the encoder.
#[derive(Clone)]
enum Arg {
    Buf(BlockHandle),
    U32(u32),
    F32(f32),
}

fn u32_arg(n: usize) -> Arg {
    Arg::U32(n as u32)
}

/// A score rule's arguments, as the attention kernels take them after the heads.
fn score_args(args: ScoreArgs) -> [Arg; 3] {
    [
        Arg::F32(args.scale),
        Arg::F32(args.softcap),
        Arg::U32(args.window as u32),
    ]
}

/// `want` threads rounded down to whole simdgroups, within the pipeline's limit.
fn threads(kernel: &Kernel, want: usize) -> usize {
    let width = kernel.simd_width.max(1);
    (want.min(kernel.max_threads) / width).max(1) * width
}

pub struct MetalBackend {
    ctx: MetalContext,
    kernels: MetalKernels,
    allocator: Option<MetalAllocator>,
    /// The two-pass attention's score scratch, carved out in `prepare`.
    scores: Option<BlockHandle>,
    kv_type: KvType,
}

impl MetalBackend {
    pub fn new() -> Result<MetalBackend> {
        let ctx = MetalContext::new(MetalDevice::system_default()?)?;
        let kernels = MetalKernels::new(&ctx.device)?;
        Ok(MetalBackend {
            ctx,
            kernels,
            allocator: None,
            scores: None,
            kv_type: KvType::F16,
        })
    }

    /// Chooses the KV cache's element type (f16 by default).
    pub fn with_kv_type(mut self, kv_type: KvType) -> MetalBackend {
        self.kv_type = kv_type;
        self
    }

    pub fn device(&self) -> &MetalDevice {
        &self.ctx.device
    }

    fn allocator(&self) -> Result<&MetalAllocator> {
        self.allocator
            .as_ref()
            .ok_or_else(|| Error::Backend("the Metal arena is not reserved".into()))
    }

    fn kv_suffix(&self) -> &'static str {
        match self.kv_type {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }

    /// Encodes one dispatch of `name` over `groups` threadgroups of `per_group(kernel)` threads.
    fn launch(
        &self,
        name: &str,
        groups: (usize, usize),
        per_group: impl FnOnce(&Kernel) -> usize,
        args: &[Arg],
    ) -> Result<()> {
        let kernel = self.kernels.get(name)?;
        let buffer = self.allocator()?.buffer();
        let threads = per_group(kernel);
        self.ctx.encode(|encoder| {
            encoder.setComputePipelineState(&kernel.pipeline);
            for (index, arg) in args.iter().enumerate() {
                // SAFETY: each index matches the kernel's [[buffer(n)]] (see kernels/); blocks are
                // inside the shared buffer; scalars are copied by the encoder before this returns.
                unsafe {
                    match arg {
                        Arg::Buf(block) => encoder.setBuffer_offset_atIndex(Some(buffer), block.offset, index),
                        Arg::U32(v) => encoder.setBytes_length_atIndex(NonNull::from(v).cast(), 4, index),
                        Arg::F32(v) => encoder.setBytes_length_atIndex(NonNull::from(v).cast(), 4, index),
                    }
                }
            }
            let grid = MTLSize {
                width: groups.0.max(1),
                height: groups.1.max(1),
                depth: 1,
            };
            let group = MTLSize {
                width: threads,
                height: 1,
                depth: 1,
            };
            encoder.dispatchThreadgroups_threadsPerThreadgroup(grid, group);
        })?;
        Ok(())
    }

    /// The two-pass attention (`attention_qk`, then `attention_pv`) over a score scratch, for heads
    /// too wide for the fused kernel; tokens go in chunks whose scores fit the scratch.
    fn attention_two_pass(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, StepContext>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores: rule,
            plan: &StepContext { n_ctx, .. },
        } = kv;
        let rule = score_args(rule.kernel_args()?);
        let scores = self
            .scores
            .ok_or_else(|| Error::Backend("no attention score scratch reserved".into()))?;
        let per_token = shape.n_heads * n_ctx * 4;
        let chunk = scores.len / per_token;
        if chunk == 0 {
            return Err(Error::Backend(format!(
                "a context of {n_ctx} positions over {} heads does not fit the {SCORES_BYTES}-byte attention scratch",
                shape.n_heads
            )));
        }
        let (qw, suffix) = (shape.q_width() * 4, self.kv_suffix());
        let (qk, pv) = (format!("attention_qk_{suffix}"), format!("attention_pv_{suffix}"));
        let qk_threads = threads(self.kernels.get(&qk)?, 64);
        // The tree reductions of attention_pv need a power-of-two group.
        let pv_threads = {
            let limit = self.kernels.get(&pv)?.max_threads.clamp(1, 256);
            1 << (usize::BITS - 1 - limit.leading_zeros())
        };
        let heads = [shape.n_heads, shape.n_kv_heads, shape.head_dim, n_ctx].map(u32_arg);
        for start in (0..n_tokens).step_by(chunk) {
            let n = chunk.min(n_tokens - start);
            let (positions, token_seqs) = (
                positions.slice(start * 4, n * 4),
                pages.token_seqs.slice(start * 4, n * 4),
            );
            let paged = |cache: BlockHandle| {
                [
                    Arg::Buf(cache),
                    Arg::Buf(positions),
                    Arg::Buf(pages.block_tables),
                    u32_arg(pages.table_width),
                    Arg::Buf(token_seqs),
                    u32_arg(pages.page_size),
                ]
            };
            let rows = n * shape.n_heads;
            let mut args = vec![Arg::Buf(q.slice(start * qw, n * qw))];
            args.extend(paged(k_cache));
            args.extend([Arg::Buf(scores), u32_arg(n)]);
            args.extend(heads.clone());
            args.extend(rule.clone());
            self.launch(&qk, (n_ctx.div_ceil(qk_threads), rows), |_| qk_threads, &args)?;
            let mut args = vec![Arg::Buf(scores)];
            args.extend(paged(v_cache));
            args.push(Arg::Buf(out.slice(start * qw, n * qw)));
            args.extend(heads.clone());
            self.launch(&pv, (rows, 1), |_| pv_threads, &args)?;
        }
        Ok(())
    }

    /// Copies `bytes` into `dst` once the GPU is done with the buffer.
    fn write_bytes(&self, dst: BlockHandle, bytes: &[u8]) -> Result<()> {
        if bytes.len() > dst.len {
            return Err(Error::Backend(format!(
                "{} bytes do not fit a block of {}",
                bytes.len(),
                dst.len
            )));
        }
        self.synchronize()?;
        // SAFETY: the block is inside the shared buffer and holds `bytes.len()` bytes; the GPU
        // is idle (synchronized above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.allocator()?.ptr(dst), bytes.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes out of `src` once the GPU has finished writing them.
    fn read_bytes(&self, src: BlockHandle, out: &mut [u8]) -> Result<()> {
        if out.len() > src.len {
            return Err(Error::Backend(format!(
                "{} bytes asked of a block of {}",
                out.len(),
                src.len
            )));
        }
        self.synchronize()?;
        // SAFETY: as write_bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.allocator()?.ptr(src), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

impl From<MetalError> for Error {
    fn from(e: MetalError) -> Error {
        Error::Metal(e)
    }
}

impl Kernels for MetalBackend {
    type Weight = MetalWeight;
    type HostF32 = Vec<f32>;
    type ChoiceSlot = Cell<u32>;
    type StepPlan = StepContext;

    fn device_name(&self) -> String {
        format!("Metal {}", self.ctx.device.name)
    }

    fn kv_type(&self) -> KvType {
        self.kv_type
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.allocator.is_some() {
            return Err(Error::Backend("the arena is already reserved".into()));
        }
        self.allocator = Some(MetalAllocator::new(&self.ctx, bytes)?);
        Ok(())
    }

    fn alloc(&mut self, bytes: usize) -> Result<BlockHandle> {
        let allocator = self
            .allocator
            .as_mut()
            .ok_or_else(|| Error::Backend("alloc before reserve".into()))?;
        Ok(allocator.alloc(bytes, ALIGN)?)
    }

    fn free(&mut self, block: BlockHandle) -> Result<()> {
        let allocator = self
            .allocator
            .as_mut()
            .ok_or_else(|| Error::Backend("free before reserve".into()))?;
        Ok(allocator.free(block)?)
    }

    fn upload_weight(&mut self, t: &HostTensor) -> Result<MetalWeight> {
        let (n_in, n_out, bytes) = matrix_bytes(t)?;
        let block = self.alloc(bytes)?;
        self.write_bytes(block, t.bytes)?;
        Ok(MetalWeight {
            ty: t.ty,
            n_out,
            n_in,
            block,
        })
    }

    /// One block for all the experts, each `bytes` after the one before: the expert kernels
    /// find expert `e` at `e * bytes` from the first.
    fn upload_experts(&mut self, tensors: &[HostTensor]) -> Result<Vec<MetalWeight>> {
        let Some(first) = tensors.first() else {
            return Err(Error::Model("a mixture of no experts".into()));
        };
        let (n_in, n_out, bytes) = matrix_bytes(first)?;
        for t in tensors {
            if t.ty != first.ty || matrix_bytes(t)? != (n_in, n_out, bytes) {
                return Err(Error::Model(format!(
                    "experts {} and {} differ in type or shape",
                    first.name, t.name
                )));
            }
        }
        let stack = self.alloc(bytes * tensors.len())?;
        let mut experts = Vec::with_capacity(tensors.len());
        for (e, t) in tensors.iter().enumerate() {
            let block = stack.slice(e * bytes, bytes);
            self.write_bytes(block, t.bytes)?;
            experts.push(MetalWeight {
                ty: t.ty,
                n_out,
                n_in,
                block,
            });
        }
        Ok(experts)
    }

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()> {
        self.write_bytes(dst, bytemuck::cast_slice(src))
    }

    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()> {
        self.write_bytes(dst, bytemuck::cast_slice(src))
    }

    fn read_f32(&self, src: BlockHandle, dst: &mut [f32]) -> Result<()> {
        self.read_bytes(src, bytemuck::cast_slice_mut(dst))
    }

    fn read_u32(&self, src: BlockHandle, dst: &mut [u32]) -> Result<()> {
        self.read_bytes(src, bytemuck::cast_slice_mut(dst))
    }

    fn host_f32(&self, len: usize) -> Result<Vec<f32>> {
        // Shared-storage buffers are already host memory: nothing to gain from anything special.
        Ok(vec![0.0; len])
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.synchronize()?)
    }

    fn weight_bytes(&self, matrices: &[usize]) -> usize {
        matrices.iter().map(|b| b + ALIGN).sum()
    }

    fn staging_bytes(&self, _largest_weight: usize, _max_tokens: usize, _max_n_in: usize) -> usize {
        SCORES_BYTES + ALIGN
    }

    fn prepare(&mut self, _max_tokens: usize, _max_n_in: usize) -> Result<()> {
        if self.scores.is_none() {
            self.scores = Some(self.alloc(SCORES_BYTES)?);
        }
        Ok(())
    }

    fn embed(&self, table: &MetalWeight, ids: BlockHandle, out: BlockHandle, n_tokens: usize) -> Result<()> {
        let suffix =
            gpu_kernel_suffix(table.ty).ok_or_else(|| Error::Backend(format!("no embed kernel for {}", table.ty)))?;
        self.launch(
            &format!("embed_{suffix}"),
            (n_tokens, 1),
            |k| threads(k, 128),
            &[Arg::Buf(table.block), Arg::Buf(ids), Arg::Buf(out), u32_arg(table.n_in)],
        )
    }

    fn rms_norm(
        &self,
        x: BlockHandle,
        weight: BlockHandle,
        out: BlockHandle,
        n_tokens: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.launch(
            "rms_norm",
            (n_tokens, 1),
            |k| threads(k, 1024),
            &[
                Arg::Buf(x),
                Arg::Buf(weight),
                Arg::Buf(out),
                u32_arg(dim),
                Arg::F32(eps),
            ],
        )
    }

    fn matmul(&self, x: BlockHandle, w: &MetalWeight, out: BlockHandle, n_tokens: usize) -> Result<()> {
        self.multiply(x.into(), w, out, n_tokens, false)
    }

    fn rope(
        &self,
        x: BlockHandle,
        positions: BlockHandle,
        freqs: BlockHandle,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<()> {
        self.launch(
            "rope",
            (n_tokens, n_heads),
            |k| threads(k, 64),
            &[
                Arg::Buf(x),
                Arg::Buf(positions),
                Arg::Buf(freqs),
                u32_arg(n_heads),
                u32_arg(head_dim),
                u32_arg(rope.dims),
                Arg::U32(u32::from(rope.layout == RopeLayout::Halves)),
                Arg::F32(rope.scale),
            ],
        )
    }

    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            ..
        }: AttentionKv<'_, StepContext>,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()> {
        self.launch(
            &format!("kv_write_{}", self.kv_suffix()),
            (n_tokens, 1),
            |k| threads(k, 256),
            &[
                Arg::Buf(k),
                Arg::Buf(v),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(positions),
                Arg::Buf(pages.block_tables),
                u32_arg(pages.table_width),
                Arg::Buf(pages.token_seqs),
                u32_arg(pages.page_size),
                u32_arg(kv_width),
            ],
        )
    }

    fn plan_step(&self, layout: StepLayout, _: AttentionShape) -> Result<StepContext> {
        let n_ctx = layout.positions.iter().max().map_or(1, |&p| p as usize + 1);
        let longest_run = layout.token_seqs.chunk_by(|a, b| a == b).map(<[u32]>::len).max();
        Ok(StepContext {
            n_ctx,
            prompt: longest_run.is_some_and(|n| n >= FLASH_MIN_RUN),
        })
    }

    fn attention(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, StepContext>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        if let Some(name) = self.flash_kernel(kv.plan, shape)? {
            return self.flash_attention(&name, q, kv, out, n_tokens, shape);
        }
        let name = format!("attention_{}", self.kv_suffix());
        let kernel = self.kernels.get(&name)?;
        let width = kernel.simd_width.max(1);
        if shape.head_dim > ATTENTION_MAX_PER_LANE * width {
            return self.attention_two_pass(q, kv, out, n_tokens, shape);
        }
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores,
            ..
        } = kv;
        let [scale, softcap, window] = score_args(scores.kernel_args()?);
        self.launch(
            &name,
            (n_tokens, shape.n_heads),
            |k| threads(k, ATTENTION_MAX_SIMDS * width),
            &[
                Arg::Buf(q),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(positions),
                Arg::Buf(pages.block_tables),
                u32_arg(pages.table_width),
                Arg::Buf(pages.token_seqs),
                u32_arg(pages.page_size),
                Arg::Buf(out),
                u32_arg(shape.n_heads),
                u32_arg(shape.n_kv_heads),
                u32_arg(shape.head_dim),
                scale,
                softcap,
                window,
            ],
        )
    }

    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()> {
        let n = n_tokens * width;
        self.elementwise(
            "add_bias",
            n,
            &[Arg::Buf(x), Arg::Buf(bias), u32_arg(n), u32_arg(width)],
        )
    }

    fn route(&self, logits: BlockHandle, routes: Routes, n_tokens: usize, routing: Routing) -> Result<()> {
        routing.check(&routes)?;
        if n_tokens == 0 {
            return Ok(()); // a grid is never empty: one group would route a token that is not there
        }
        self.launch(
            "route",
            (n_tokens, 1),
            |k| k.simd_width.max(1),
            &[
                Arg::Buf(logits),
                Arg::Buf(routes.ids),
                Arg::Buf(routes.weights),
                u32_arg(routing.n_experts),
                u32_arg(routing.k),
                Arg::U32(u32::from(routing.renormalize)),
            ],
        )
    }

    /// Each (token, choice) pair's gate and up products with the gated activation (one dispatch
    /// where gate and up are of one type), the down products, then their weighted sum into the
    /// residual; every expert product reads its expert's id where `route` left it. (An id
    /// outside the set makes NaN rows: see matmul.metal.)
    fn experts(
        &self,
        x: BlockHandle,
        set: ExpertSet<'_, MetalWeight>,
        routes: Routes,
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let (dim, width) = set.shape()?;
        let pairs = n_tokens * routes.k;
        if pairs == 0 {
            return Ok(()); // as in `route`
        }
        let (gate, gate_bytes) = expert_stack(set.gate)?;
        let (up, _) = expert_stack(set.up)?;
        if gate.ty == up.ty {
            self.launch_expert_rows(
                &format!("matmul_glu_experts_{}", weight_suffix(gate)?),
                gate.n_out,
                pairs,
                &[
                    Arg::Buf(gate.block),
                    Arg::Buf(up.block),
                    Arg::Buf(routes.ids),
                    Arg::Buf(x),
                    Arg::Buf(scratch.hidden),
                    u32_arg(gate.n_in),
                    u32_arg(gate.n_out),
                    Arg::U32(gate_bytes),
                    u32_arg(set.n_experts()),
                    u32_arg(routes.k),
                    Arg::U32(set.activation.code()),
                ],
            )?;
        } else {
            self.expert_products(set.gate, routes, x, routes.k, scratch.gate, pairs)?;
            self.expert_products(set.up, routes, x, routes.k, scratch.up, pairs)?;
            self.glu(scratch.gate, scratch.up, scratch.hidden, pairs * width, set.activation)?;
        }
        self.expert_products(set.down, routes, scratch.hidden, 1, scratch.out, pairs)?;
        let n = n_tokens * dim;
        self.elementwise(
            "experts_sum",
            n,
            &[
                Arg::Buf(residual),
                Arg::Buf(scratch.out),
                Arg::Buf(routes.weights),
                u32_arg(n),
                u32_arg(dim),
                u32_arg(routes.k),
            ],
        )
    }

    fn add_gated(
        &self,
        x: BlockHandle,
        rows: BlockHandle,
        gates: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()> {
        let n = n_tokens * width;
        self.elementwise(
            "add_gated",
            n,
            &[Arg::Buf(x), Arg::Buf(rows), Arg::Buf(gates), u32_arg(n), u32_arg(width)],
        )
    }

    fn glu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize, act: Activation) -> Result<()> {
        self.elementwise(
            "glu",
            n,
            &[
                Arg::Buf(gate),
                Arg::Buf(up),
                Arg::Buf(out),
                u32_arg(n),
                Arg::U32(act.code()),
            ],
        )
    }

    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        self.elementwise("add", n, &[Arg::Buf(x), Arg::Buf(y), u32_arg(n)])
    }

    fn scale(&self, x: BlockHandle, factor: f32, n: usize) -> Result<()> {
        self.elementwise("scale", n, &[Arg::Buf(x), u32_arg(n), Arg::F32(factor)])
    }

    fn softcap(&self, x: BlockHandle, cap: f32, n: usize) -> Result<()> {
        self.elementwise("softcap", n, &[Arg::Buf(x), u32_arg(n), Arg::F32(cap)])
    }

    fn argmax(
        &self,
        x: BlockHandle,
        out: BlockHandle,
        n_rows: usize,
        width: usize,
        allowed: Option<BlockHandle>,
    ) -> Result<()> {
        // Unconstrained rows still bind a buffer there; the kernel does not read it.
        let (bits, constrained) = allowed.map_or((x, 0), |a| (a, 1));
        self.launch(
            "argmax",
            (n_rows, 1),
            |k| threads(k, 1024),
            &[
                Arg::Buf(x),
                Arg::Buf(out),
                u32_arg(width),
                Arg::Buf(bits),
                Arg::U32(constrained),
            ],
        )
    }

    // Read at once: overlapping it would take the index into a buffer of its own and a wait on
    // its command buffer alone.
    super::choices_at_once!();
}

impl Backend for MetalBackend {
    fn matmul_many(&self, x: Input, ws: &[&MetalWeight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        // The row kernel normalizes as it reads; rows for the tiled one are normalized once for all.
        let mut tiled = false;
        for w in ws {
            tiled |= self.tiled_kernel(w, n_tokens)?.is_some();
        }
        let x = match (x, ws.first()) {
            (Input::RmsNormed { .. }, Some(w)) if tiled => Input::Rows(self.input_rows(x, n_tokens, w.n_in)?),
            _ => x,
        };
        for (w, &out) in ws.iter().zip(outs) {
            self.multiply(x, w, out, n_tokens, false)?;
        }
        Ok(())
    }

    fn matmul_add(&self, x: BlockHandle, w: &MetalWeight, residual: Residual, n_tokens: usize) -> Result<()> {
        self.multiply(x.into(), w, residual.stream, n_tokens, true)
    }

    fn gate_up_glu(
        &self,
        x: Input,
        [gate, up]: [&MetalWeight; 2],
        rows: GluRows,
        n_tokens: usize,
        act: Activation,
    ) -> Result<()> {
        // Prompts run the tiled kernel twice and the glu: one dispatch more among far longer ones.
        let alike = gate.ty == up.ty && gate.n_in == up.n_in && gate.n_out == up.n_out;
        if !alike || self.tiled_kernel(gate, n_tokens)?.is_some() {
            return gate_up_glu_in_steps(self, x, [gate, up], rows, n_tokens, act);
        }
        let (x, norm) = row_input(x);
        let mut args = vec![
            Arg::Buf(gate.block),
            Arg::Buf(up.block),
            Arg::Buf(x),
            Arg::Buf(rows.out),
            u32_arg(gate.n_in),
            u32_arg(gate.n_out),
            u32_arg(n_tokens),
            Arg::U32(act.code()),
        ];
        args.extend(norm);
        self.launch_rows(&format!("matmul_glu_{}", weight_suffix(gate)?), gate.n_out, &args)
    }

    fn rope_kv_write(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, StepContext>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let NewRows { q, k, v, freqs, rope } = new;
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            ..
        } = kv;
        self.launch(
            &format!("rope_kv_write_{}", self.kv_suffix()),
            (n_tokens, shape.n_heads + shape.n_kv_heads),
            |k| threads(k, 64),
            &[
                Arg::Buf(q),
                Arg::Buf(k),
                Arg::Buf(v),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(positions),
                Arg::Buf(freqs),
                Arg::Buf(pages.block_tables),
                u32_arg(pages.table_width),
                Arg::Buf(pages.token_seqs),
                u32_arg(pages.page_size),
                u32_arg(shape.n_heads),
                u32_arg(shape.n_kv_heads),
                u32_arg(shape.head_dim),
                u32_arg(rope.dims),
                Arg::U32(u32::from(rope.layout == RopeLayout::Halves)),
                Arg::F32(rope.scale),
            ],
        )
    }
}

/// A 2-D tensor's `(n_in, n_out, bytes)`, checked to be a type the kernels read and to hold
/// its shape.
fn matrix_bytes(t: &HostTensor) -> Result<(usize, usize, usize)> {
    let (n_in, n_out) = t.matrix_shape()?;
    gpu_kernel_suffix(t.ty).ok_or_else(|| Error::UnsupportedTensorType {
        name: t.name.to_string(),
        ty: t.ty.to_string(),
        op: "the Metal backend",
    })?;
    let bytes =
        t.ty.bytes_for(n_in)
            .and_then(|row| row.checked_mul(n_out))
            .filter(|&b| b == t.bytes.len())
            .ok_or_else(|| {
                Error::Model(format!(
                    "tensor {}: {} bytes do not hold its shape",
                    t.name,
                    t.bytes.len()
                ))
            })?;
    Ok((n_in, n_out, bytes))
}

/// The first of a layer's experts' matrices and the bytes from one expert to the next, checked
/// to be one stack of one type as `upload_experts` leaves them.
fn expert_stack(matrices: &[MetalWeight]) -> Result<(&MetalWeight, u32)> {
    let Some(first) = matrices.first() else {
        return Err(Error::Backend("experts: a mixture of no experts".into()));
    };
    let stride = first.block.len;
    let stacked = matrices
        .iter()
        .enumerate()
        .all(|(e, w)| w.ty == first.ty && w.block.offset == first.block.offset + e * stride);
    if !stacked {
        return Err(Error::Backend(
            "experts: the matrices are not one stack of one type (upload them with upload_experts)".into(),
        ));
    }
    let bytes = u32::try_from(stride)
        .map_err(|_| Error::Backend(format!("experts: a matrix of {stride} bytes is over 4 GiB")))?;
    Ok((first, bytes))
}

/// The kernel suffix of a weight's type.
fn weight_suffix(w: &MetalWeight) -> Result<&'static str> {
    gpu_kernel_suffix(w.ty).ok_or_else(|| Error::Backend(format!("no matmul kernel for {}", w.ty)))
}

/// The activations a row kernel reads, and its norm arguments: the RMS norm's weight, epsilon and
/// whether to take it (the rows themselves stand in for the weight, unread, where it is not).
fn row_input(x: Input) -> (BlockHandle, [Arg; 3]) {
    match x {
        Input::Rows(rows) => (rows, [Arg::Buf(rows), Arg::F32(0.0), Arg::U32(0)]),
        Input::RmsNormed { x, weight, eps, .. } => (x, [Arg::Buf(weight), Arg::F32(eps), Arg::U32(1)]),
    }
}

impl MetalBackend {
    /// The tiled matmul's kernel for `w` where a step of `n_tokens` runs it: from
    /// `TILED_MIN_TOKENS`, and only where the pipeline runs 32-wide simdgroups and a whole tile.
    fn tiled_kernel(&self, w: &MetalWeight, n_tokens: usize) -> Result<Option<String>> {
        if n_tokens < TILED_MIN_TOKENS {
            return Ok(None);
        }
        let name = format!("matmul_tiled_{}", weight_suffix(w)?);
        let kernel = self.kernels.get(&name)?;
        let fits =
            kernel.simd_width == SIMDGROUP_MATRIX_LANES && kernel.max_threads >= TILE_SIMDS * SIMDGROUP_MATRIX_LANES;
        Ok(fits.then_some(name))
    }

    /// `out = x w^T`, or `out += x w^T` with `accumulate`: the row kernel for a few tokens (which
    /// takes an RMS norm on the way in), the tiled one from `TILED_MIN_TOKENS` (on rows normalized
    /// first, where `x` asks for a norm).
    fn multiply(&self, x: Input, w: &MetalWeight, out: BlockHandle, n_tokens: usize, accumulate: bool) -> Result<()> {
        if let Some(tiled) = self.tiled_kernel(w, n_tokens)? {
            let x = self.input_rows(x, n_tokens, w.n_in)?;
            return self.launch(
                &tiled,
                (w.n_out.div_ceil(TILE_O), n_tokens.div_ceil(TILE_T)),
                |_| TILE_SIMDS * SIMDGROUP_MATRIX_LANES,
                &[
                    Arg::Buf(w.block),
                    Arg::Buf(x),
                    Arg::Buf(out),
                    u32_arg(w.n_in),
                    u32_arg(w.n_out),
                    u32_arg(n_tokens),
                    Arg::U32(u32::from(accumulate)),
                ],
            );
        }
        let (x, norm) = row_input(x);
        let mut args = vec![
            Arg::Buf(w.block),
            Arg::Buf(x),
            Arg::Buf(out),
            u32_arg(w.n_in),
            u32_arg(w.n_out),
            u32_arg(n_tokens),
            Arg::U32(u32::from(accumulate)),
        ];
        args.extend(norm);
        self.launch_rows(&format!("matmul_{}", weight_suffix(w)?), w.n_out, &args)
    }

    /// `out[p] = matrices[ids[p]] x[p / per_x]` for `pairs` (token, choice) pairs, the experts'
    /// matrices as `upload_experts` stacked them.
    fn expert_products(
        &self,
        matrices: &[MetalWeight],
        routes: Routes,
        x: BlockHandle,
        per_x: usize,
        out: BlockHandle,
        pairs: usize,
    ) -> Result<()> {
        let (first, expert_bytes) = expert_stack(matrices)?;
        self.launch_expert_rows(
            &format!("matmul_experts_{}", weight_suffix(first)?),
            first.n_out,
            pairs,
            &[
                Arg::Buf(first.block),
                Arg::Buf(routes.ids),
                Arg::Buf(x),
                Arg::Buf(out),
                u32_arg(first.n_in),
                u32_arg(first.n_out),
                Arg::U32(expert_bytes),
                u32_arg(matrices.len()),
                u32_arg(per_x),
            ],
        )
    }

    /// An expert row kernel: a row kernel's simdgroup per row of `n_out`, a row of threadgroups
    /// per pair.
    fn launch_expert_rows(&self, name: &str, n_out: usize, pairs: usize, args: &[Arg]) -> Result<()> {
        let kernel = self.kernels.get(name)?;
        let width = kernel.simd_width.max(1);
        let rows_per_group = threads(kernel, 4 * width) / width;
        self.launch(
            name,
            (n_out.div_ceil(rows_per_group), pairs),
            |_| rows_per_group * width,
            args,
        )
    }

    /// A row kernel over `n_out` rows: one simdgroup per row, four rows per threadgroup where the
    /// pipeline allows.
    fn launch_rows(&self, name: &str, n_out: usize, args: &[Arg]) -> Result<()> {
        let kernel = self.kernels.get(name)?;
        let width = kernel.simd_width.max(1);
        let rows_per_group = threads(kernel, 4 * width) / width;
        self.launch(
            name,
            (n_out.div_ceil(rows_per_group), 1),
            |_| rows_per_group * width,
            args,
        )
    }

    /// The prompt attention's kernel for this step and head size, if it runs it: steps of a
    /// prompt (`FLASH_MIN_RUN`), heads of up to the widest class, pipelines of 32-wide simdgroups
    /// that take a whole tile.
    fn flash_kernel(&self, plan: &StepContext, shape: AttentionShape) -> Result<Option<String>> {
        let Some(class) = FLASH_HEAD_CLASSES.iter().find(|&&c| shape.head_dim <= c) else {
            return Ok(None);
        };
        if !plan.prompt {
            return Ok(None);
        }
        let name = format!("flash_attention_{}_{class}", self.kv_suffix());
        let kernel = self.kernels.get(&name)?;
        let fits =
            kernel.simd_width == SIMDGROUP_MATRIX_LANES && kernel.max_threads >= FLASH_SIMDS * SIMDGROUP_MATRIX_LANES;
        Ok(fits.then_some(name))
    }

    /// The prompt attention: tiles of `FLASH_ROWS` tokens by one head.
    fn flash_attention(
        &self,
        name: &str,
        q: BlockHandle,
        kv: AttentionKv<'_, StepContext>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores,
            ..
        } = kv;
        let [scale, softcap, window] = score_args(scores.kernel_args()?);
        self.launch(
            name,
            (n_tokens.div_ceil(FLASH_ROWS), shape.n_heads),
            |_| FLASH_SIMDS * SIMDGROUP_MATRIX_LANES,
            &[
                Arg::Buf(q),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(positions),
                Arg::Buf(pages.block_tables),
                u32_arg(pages.table_width),
                Arg::Buf(pages.token_seqs),
                u32_arg(pages.page_size),
                Arg::Buf(out),
                u32_arg(n_tokens),
                u32_arg(shape.n_heads),
                u32_arg(shape.n_kv_heads),
                u32_arg(shape.head_dim),
                scale,
                softcap,
                window,
            ],
        )
    }

    /// A one-thread-per-value kernel over `n` values.
    fn elementwise(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
        let per_group = threads(self.kernels.get(name)?, 256);
        self.launch(name, (n.div_ceil(per_group), 1), |_| per_group, args)
    }
}

#[cfg(test)]
mod tests {
    use super::{FLASH_HEAD_CLASSES, FLASH_ROWS, FLASH_SIMDS, TILE_O, TILE_SIMDS, TILE_T};

    #[test]
    fn the_flash_dispatch_uses_the_kernels_tile_and_classes() {
        let source = include_str!("kernels/flash_attention.metal");
        let tile = format!("FA_ROWS = {FLASH_ROWS}, FA_SIMDS = {FLASH_SIMDS},");
        assert!(
            source.contains(&tile),
            "flash_attention.metal's tile is not the one the dispatcher's grid assumes ({tile})"
        );
        for class in FLASH_HEAD_CLASSES {
            for (name, ty) in [("f16", "half"), ("f32", "float")] {
                let kernel = format!("FLASH_ATTENTION({name}, {ty}, {class})");
                assert!(
                    source.contains(&kernel),
                    "no kernel {kernel} for a head class the dispatcher picks"
                );
            }
        }
    }

    #[test]
    fn the_tiled_dispatch_uses_the_kernels_tile() {
        let source = include_str!("kernels/matmul_tiled.metal");
        let shape = format!("TILE_T = {TILE_T}, TILE_O = {TILE_O}, TILE_K = 32, TILE_SIMDS = {TILE_SIMDS} }};");
        assert!(
            source.contains(&shape),
            "matmul_tiled.metal's tile is not the one the dispatcher's grid assumes ({shape})"
        );
    }
}
