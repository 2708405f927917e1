//! The CUDA backend: the four backend layers (device, context, allocator, kernels) on an NVIDIA GPU.
//!
//! [`device`] finds the GPU through the driver (loaded at run time); the context is one stream
//! for everything, with CUDA graphs recorded from it for the decode step; the allocator is the
//! shared [`Arena`] over one device allocation reserved at load; [`kernels`] holds every kernel,
//! compiled once by NVRTC. Decode matmuls read the stored weight types directly; prefill matmuls
//! go through cuBLAS (quantized weights dequantized to f16 first), unless the backend takes
//! `Paths::BatchInvariant` (paths.rs: `--deterministic`), which keeps every step on one set of
//! kernels.
//!
//! This file holds the backend's state and its `Kernels` and `Backend` impls, which hand each op
//! to the file beside that op's kernels (`matmul.rs` beside kernels/matmul.cu, `norms.rs` beside
//! rms_norm.cu); launch plumbing, weight repacking, occupancy, memory and graphs have one each.

pub mod device;
pub mod kernels;
pub mod params;

mod argmax;
mod attention;
mod elementwise;
mod embed;
mod expert_gemm;
mod experts;
mod flash_attention;
mod fp8_gemm;
mod gemm;
mod graphs;
mod kv_write;
mod launch;
mod matmul;
mod memory;
mod nccl;
mod norms;
mod occupancy;
mod paths;
mod rope;
mod weights;

use super::{
    Activation, Arena, AttentionKv, AttentionShape, Backend, BlockHandle, ExpertScratch, ExpertSet, FeedForward,
    FeedForwardScratch, GluRows, HostTensor, Input, KvType, Mixture, MixtureScratch, NewRows, NextInput, Projection,
    Residual, Rope, Routes, Routing, StepLayout,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
pub use argmax::ChoiceSlot;
use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream};
pub use device::PinnedF32;
use device::{driver_error, CudaDevice};
use flash_attention::flash_head_dims;
pub use flash_attention::FlashPlan;
use kernels::Kernels;
use memory::ALIGN;
pub use nccl::Nccl;
use occupancy::{prefer_shared_memory, quantize_padding, EvenSpread};
pub use paths::Paths;
use std::cell::RefCell;
use std::sync::Arc;
pub use weights::CudaWeight;

pub struct CudaBackend {
    pub device: CudaDevice,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    blas: cublas_sys::cublasHandle_t,
    memory: Option<CudaSlice<u8>>,
    base: sys::CUdeviceptr,
    arena: Arena,
    /// f16 staging for cuBLAS: a dequantized weight, and the converted activations.
    staging: Option<(BlockHandle, BlockHandle)>,
    /// The query tiles of a flash-attention step (two u32 per tile, at most one tile a token).
    flash_tiles: Option<BlockHandle>,
    /// Each token's RoPE angles, (cos, sin) of each pair as two f32, where flash attention
    /// rotates the queries itself (`rope_attend_and_project`): at most `FLASH_MAX_PAIRS` a token.
    flash_turns: Option<BlockHandle>,
    /// Activations quantized for the integer matrix-vector kernels: int8 values, f32 block scales.
    int8_activations: Option<(BlockHandle, BlockHandle)>,
    largest_weight: usize,
    graphs: RefCell<Vec<CudaGraph>>,
    /// Each row's key and arrival count for `argmax` (kernels/argmax.cu), zero between launches:
    /// past the arena's end, in the same allocation.
    argmax_state: sys::CUdeviceptr,
    /// After it, the softmax states that the one-pass attention's splits post to each other (at
    /// most one head a multiprocessor; `partials` in attention.cu), zero between launches.
    attention_partials: sys::CUdeviceptr,
    /// After them, router_route's count of its blocks done (kernels/experts.cu), zero between
    /// launches.
    router_done: sys::CUdeviceptr,
    /// How Q4_K's one-token kernels (products, SwiGLU) spread their blocks; none where a
    /// multiprocessor's shared memory holds only one of their blocks. (Boxed: the backend is moved
    /// about by value.)
    q4k_spread: Option<Box<[EvenSpread; 2]>>,
    /// Shared memory (unused) a quantize_q8 launch for Q4_K of at most a block a multiprocessor
    /// asks for (`quantize_padding`).
    quantize_padding: u32,
    /// The head sizes whose flash-attention blocks the device has the shared memory for.
    flash_head_dims: Vec<usize>,
    /// Whether flash attention runs on the warpgroup MMAs (Hopper).
    flash_warpgroups: bool,
    /// Flash attention's blocks' groups of 64 query rows and their kernel, where fixed
    /// (`with_flash_kernel`).
    flash_fixed: Option<(usize, bool)>,
    /// The most tokens a step may have to be recorded: every matmul must use our own kernels.
    capture_max_tokens: usize,
    kv_type: KvType,
    /// The kernels a step may take: the fastest for its size, or the same for every step.
    paths: Paths,
    /// cuBLASLt's FP8 GEMM, for prompts' products of FP8 weights, where the device has it.
    fp8_lt: Option<fp8_gemm::Fp8Lt>,
}

impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let device = CudaDevice::new(ordinal)?;
        // A stream of our own: the legacy default stream cannot be captured into graphs.
        let stream = device.ctx.new_stream().map_err(driver_error("stream"))?;
        let kernels = Kernels::load(&device.ctx, device.arch, device.driver_version)?;
        let q4k = Self::type_suffix(GgmlType::Q4K)?;
        let spread = |glu| EvenSpread::new(&device, kernels.get(&kernels::gemv_kernel(true, glu, q4k, 1))?);
        prefer_shared_memory(kernels.get(&kernels::gemv_kernel(true, true, q4k, 1))?)?;
        let q4k_spread = match (spread(false)?, spread(true)?) {
            (Some(products), Some(swiglu)) => Some(Box::new([products, swiglu])),
            _ => None,
        };
        let quantize_padding = quantize_padding(&device, kernels.get("quantize_q8")?)?;
        let flash_warpgroups = kernels::has_warpgroup_mma(device.arch);
        let flash_head_dims = flash_head_dims(&device, &kernels)?;
        expert_gemm::allow_expert_gemm_shared(&device, &kernels)?;
        // SAFETY: only probes for the shared library.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(Error::Backend("cuBLAS (libcublas.so) is not installed".into()));
        }
        let blas = cublas::create_handle().map_err(|e| Error::Backend(format!("cuBLAS: {e:?}")))?;
        let fp8_lt = fp8_gemm::Fp8Lt::new(device.arch)?;
        // SAFETY: both handles are live; all work goes to this one stream.
        unsafe { cublas::set_stream(blas, stream.cu_stream() as _) }
            .map_err(|e| Error::Backend(format!("cuBLAS: {e:?}")))?;
        Ok(CudaBackend {
            device,
            stream,
            kernels,
            blas,
            memory: None,
            base: 0,
            arena: Arena::new(0),
            staging: None,
            flash_tiles: None,
            flash_turns: None,
            int8_activations: None,
            largest_weight: 0,
            graphs: RefCell::new(Vec::new()),
            argmax_state: 0,
            attention_partials: 0,
            router_done: 0,
            q4k_spread,
            quantize_padding,
            flash_head_dims,
            flash_warpgroups,
            flash_fixed: None,
            capture_max_tokens: Paths::Fastest.capture_max_tokens(),
            kv_type: KvType::F16,
            paths: Paths::Fastest,
            fp8_lt,
        })
    }

    /// Chooses the kernels a step may take (`Paths::Fastest` by default); before the weights are
    /// uploaded, as the graphs' step sizes and the staging follow from it.
    pub fn with_paths(mut self, paths: Paths) -> CudaBackend {
        self.paths = paths;
        self.capture_max_tokens = paths.capture_max_tokens();
        self
    }

    /// Multiplies prompts' FP8 weights as other quantized ones, dequantized to f16 for cuBLAS,
    /// rather than on the FP8 tensor cores (as `AXIOM_CUDA_FP8_GEMM=dequant` does); before the
    /// weights are uploaded.
    pub fn without_fp8_tensor_cores(mut self) -> CudaBackend {
        self.fp8_lt = None;
        self
    }

    /// Chooses the KV cache's element type (f16 by default).
    pub fn with_kv_type(mut self, kv_type: KvType) -> CudaBackend {
        self.kv_type = kv_type;
        self
    }
}

// SAFETY: what is not Send in the backend is its handles (cuBLAS, cuBLASLt, graphs), which
// belong to its CUDA context, not to a thread; they are used through `&self` from one thread at a
// time (the backend is not Sync), and an op on a thread where the context is not current fails
// with a CUDA error rather than misbehaving (`enter_thread` makes it current).
unsafe impl Send for CudaBackend {}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: created in `new`, used by no one after this.
        let _ = unsafe { cublas::destroy_handle(self.blas) };
    }
}

impl super::Kernels for CudaBackend {
    type Weight = CudaWeight;
    type HostF32 = PinnedF32;
    type ChoiceSlot = ChoiceSlot;
    /// The flash-attention tiles of a step that takes flash attention.
    type StepPlan = Option<FlashPlan>;

    fn device_name(&self) -> String {
        format!("CUDA {} ({})", self.device.name, self.device.arch)
    }

    fn kv_type(&self) -> KvType {
        self.kv_type
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        self.reserve_memory(bytes)
    }

    fn alloc(&mut self, bytes: usize) -> Result<BlockHandle> {
        if self.memory.is_none() {
            return Err(Error::Backend("alloc before reserve".into()));
        }
        Ok(self.arena.alloc(bytes, ALIGN)?)
    }

    fn free(&mut self, block: BlockHandle) -> Result<()> {
        Ok(self.arena.free(block)?)
    }

    fn upload_weight(&mut self, t: &HostTensor) -> Result<CudaWeight> {
        self.upload_split_weight(t)
    }

    fn upload_experts(&mut self, tensors: &[HostTensor]) -> Result<Vec<CudaWeight>> {
        self.upload_expert_stack(tensors)
    }

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()> {
        assert!(std::mem::size_of_val(src) <= dst.len);
        // SAFETY: bounds checked above; the copy completes before the call returns (pageable memory).
        unsafe { cudarc::driver::result::memcpy_htod_async(self.ptr(dst), src, self.stream.cu_stream()) }
            .map_err(driver_error("copy to device"))
    }

    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()> {
        assert!(std::mem::size_of_val(src) <= dst.len);
        // SAFETY: as write_f32.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.ptr(dst), src, self.stream.cu_stream()) }
            .map_err(driver_error("copy to device"))
    }

    fn read_u32(&self, src: BlockHandle, dst: &mut [u32]) -> Result<()> {
        assert!(std::mem::size_of_val(dst) <= src.len);
        // SAFETY: as read_f32.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, self.ptr(src), self.stream.cu_stream()) }
            .map_err(driver_error("copy to host"))?;
        self.synchronize()
    }

    fn read_f32(&self, src: BlockHandle, dst: &mut [f32]) -> Result<()> {
        assert!(std::mem::size_of_val(dst) <= src.len);
        // SAFETY: bounds checked above; synchronized before returning.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, self.ptr(src), self.stream.cu_stream()) }
            .map_err(driver_error("copy to host"))?;
        self.synchronize()
    }

    fn host_f32(&self, len: usize) -> Result<PinnedF32> {
        PinnedF32::new(&self.device.ctx, len)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error("synchronize"))
    }

    fn enter_thread(&self) -> Result<()> {
        self.device.ctx.bind_to_thread().map_err(driver_error("context"))
    }

    fn profile(&self, on: bool) -> Result<()> {
        self.synchronize()?;
        // SAFETY: both calls take no arguments and act on the context current on this thread.
        let status = unsafe {
            match on {
                true => cudarc::driver::sys::cuProfilerStart(),
                false => cudarc::driver::sys::cuProfilerStop(),
            }
        };
        status.result().map_err(driver_error("profiler"))
    }

    fn weight_bytes(&self, matrices: &[usize]) -> usize {
        weights::arena_bytes(matrices)
    }

    fn staging_bytes(&self, largest_weight: usize, max_tokens: usize, max_n_in: usize) -> usize {
        let fp8 = self.fp8_tensor_cores();
        memory::staging_bytes(self.paths, largest_weight, max_tokens, max_n_in, fp8)
    }

    fn prepare(&mut self, max_tokens: usize, max_n_in: usize) -> Result<()> {
        self.reserve_staging(max_tokens, max_n_in)
    }

    fn begin_capture(&self, n_tokens: usize) -> Result<bool> {
        self.begin_graph(n_tokens)
    }

    fn end_capture(&self) -> Result<usize> {
        self.end_graph()
    }

    fn replay(&self, graph: usize) -> Result<()> {
        self.launch_graph(graph)
    }

    fn embed(&self, table: &CudaWeight, ids: BlockHandle, out: BlockHandle, n_tokens: usize) -> Result<()> {
        self.launch_embed(table, ids, out, n_tokens)
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
        self.launch_rms_norm(x, weight, out, n_tokens, dim, eps)
    }

    fn matmul(&self, x: BlockHandle, w: &CudaWeight, out: BlockHandle, n_tokens: usize) -> Result<()> {
        self.multiply(x.into(), &[w], &[out], n_tokens)
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
        self.launch_rope(x, positions, freqs, n_tokens, n_heads, head_dim, rope)
    }

    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()> {
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            ..
        } = kv;
        self.launch_kv_write(k, v, k_cache, v_cache, positions, pages, n_tokens, kv_width)
    }

    fn plan_step(&self, layout: StepLayout, shape: AttentionShape) -> Result<Option<FlashPlan>> {
        self.plan_flash(layout, shape)
    }

    fn attention(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        self.attend(q, None, kv, out, None, n_tokens, shape)
    }

    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()> {
        self.launch_add_bias(x, bias, n_tokens, width)
    }

    fn route(&self, logits: BlockHandle, routes: Routes, n_tokens: usize, routing: Routing) -> Result<()> {
        self.launch_route(logits, routes, n_tokens, routing)
    }

    fn experts(
        &self,
        x: BlockHandle,
        set: ExpertSet<'_, CudaWeight>,
        routes: Routes,
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        self.run_experts(x, None, set, routes, scratch, residual, n_tokens)
    }

    fn add_gated(
        &self,
        x: BlockHandle,
        rows: BlockHandle,
        gates: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()> {
        self.launch_add_gated(x, rows, gates, n_tokens, width)
    }

    fn glu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize, act: Activation) -> Result<()> {
        self.launch_glu(gate, up, out, n, act)
    }

    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        self.launch_add(x, y, n)
    }

    fn scale(&self, x: BlockHandle, factor: f32, n: usize) -> Result<()> {
        self.launch_scale("scale", x, factor, n)
    }

    fn softcap(&self, x: BlockHandle, cap: f32, n: usize) -> Result<()> {
        self.launch_scale("softcap", x, cap, n)
    }

    fn argmax(
        &self,
        x: BlockHandle,
        out: BlockHandle,
        n_rows: usize,
        width: usize,
        allowed: Option<BlockHandle>,
    ) -> Result<()> {
        self.argmax_rows(x, out, n_rows, width, allowed)
    }

    fn choice_slot(&self) -> Result<ChoiceSlot> {
        ChoiceSlot::new(&self.device.ctx)
    }

    fn queue_argmax(&self, x: BlockHandle, next: NextInput, width: usize, slot: &ChoiceSlot) -> Result<()> {
        self.queue_choice(x, next, width, slot)
    }

    fn mark_choice(&self, slot: &ChoiceSlot) -> Result<()> {
        slot.mark(&self.stream)
    }

    fn wait_choice(&self, slot: &ChoiceSlot) -> Result<u32> {
        slot.wait()
    }
}

impl Backend for CudaBackend {
    fn matmul_many(&self, x: Input, ws: &[&CudaWeight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        self.multiply(x, ws, outs, n_tokens)
    }

    fn matmul_add(&self, x: BlockHandle, w: &CudaWeight, residual: Residual, n_tokens: usize) -> Result<()> {
        self.multiply_add(x, w, residual.stream, n_tokens)
    }

    fn gate_up_glu(
        &self,
        x: Input,
        ws: [&CudaWeight; 2],
        rows: GluRows,
        n_tokens: usize,
        act: Activation,
    ) -> Result<()> {
        self.gate_up_glu_products(x, ws, rows, n_tokens, act)
    }

    fn feed_forward(
        &self,
        x: Input,
        ffn: FeedForward<'_, CudaWeight>,
        scratch: FeedForwardScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        self.feed_forward_16bit(x, ffn, scratch, residual, n_tokens)
    }

    fn head_norms(
        &self,
        x: [BlockHandle; 2],
        weights: [BlockHandle; 2],
        out: [BlockHandle; 2],
        n_tokens: usize,
        shape: AttentionShape,
        eps: f32,
    ) -> Result<()> {
        self.launch_head_norms(x, weights, out, n_tokens, shape, eps)
    }

    fn mixture(
        &self,
        x: Input,
        m: Mixture<'_, CudaWeight>,
        scratch: MixtureScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        self.run_mixture(x, m, scratch, residual, n_tokens)
    }

    fn rope_kv_write(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        self.rotate_and_store(new, kv, n_tokens, shape, None)
    }

    fn attend_and_project(
        &self,
        q: BlockHandle,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        proj: Projection<'_, CudaWeight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        self.attend_then_project(q, None, kv, proj, n_tokens, shape)
    }

    fn rope_attend_and_project(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        proj: Projection<'_, CudaWeight>,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        self.rope_attend_then_project(new, kv, proj, n_tokens, shape)
    }
}
