//! The CUDA backend: the four backend layers (device, context, allocator, kernels) on an NVIDIA GPU.
//!
//! [`device`] finds the GPU through the driver (loaded at run time); the context is one stream
//! for everything, with CUDA graphs recorded from it for the decode step; the allocator is the
//! shared [`Arena`] over one device allocation reserved at load; [`kernels`] holds every kernel,
//! compiled once by NVRTC. Decode matmuls read the stored weight types directly; prefill matmuls
//! go through cuBLAS (quantized weights dequantized to f16 first).

pub mod device;
pub mod kernels;

use super::{
    feed_forward_in_steps, gate_up_swiglu_in_steps, rope_attend_and_project_in_steps, Arena, AttentionKv,
    AttentionShape, Backend, BlockHandle, FeedForward, FeedForwardScratch, HostTensor, Input, KvType, NewRows,
    NextInput, PagedKv, Rope, RopeLayout,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaSlice, CudaStream};
pub use device::PinnedF32;
use device::{driver_error, CudaDevice, Pinned};
use kernels::Kernels;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::Arc;

const ALIGN: usize = 256;
/// Tokens up to which a matmul of quantized weights uses the matrix-vector kernels rather than
/// cuBLAS (which needs the whole matrix dequantized first).
const GEMV_MAX_TOKENS: usize = 8;

/// Rows one `argmax` launch takes at most (it keeps a key and a count for each).
const ARGMAX_ROWS: usize = 32;
/// Its blocks' threads and the values each block takes (ARGMAX_THREADS, ARGMAX_PER_BLOCK in
/// kernels/argmax.cu).
const ARGMAX_THREADS: u32 = 256;
const ARGMAX_PER_BLOCK: usize = 2048;

/// Tokens up to which a matmul of weights of type `ty` uses the matrix-vector kernels. Float
/// weights go to cuBLAS from two tokens on: there is nothing to dequantize, and the kernels'
/// activation reads grow with every token.
fn gemv_max_tokens(ty: GgmlType) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
        _ => GEMV_MAX_TOKENS,
    }
}

/// Quantized matrices with rows at least this long are multiplied on integers (gemv_int in
/// matmul.cu: activations quantized to int8, dp4a), and so are matrices of at least
/// `INT_GEMV_MIN_VALUES` (a small model's output head). Other small ones keep the f32 kernels:
/// their products are too small to repay the extra launch that quantizes the activations.
const INT_GEMV_MIN_N_IN: usize = 2048;
const INT_GEMV_MIN_VALUES: usize = 16 << 20;
/// The f32 matrix-vector kernels normalize their input themselves (each block its own copy, in
/// shared memory) for matrices up to this many values: a small model's decode is latency-bound,
/// and the norm's own launch costs more. Large ones stream their weights, and a block that
/// normalizes first streams later.
const NORMED_GEMV_MAX_VALUES: usize = 4 << 20;

/// Steps of at least this many tokens run attention on tensor cores (flash_attention.cu), where
/// the f16 cache and the head size allow; smaller ones, decode above all, use the one-pass kernel.
const FLASH_MIN_TOKENS: usize = 32;
/// Threads of the one-pass attention kernel (ATTN_THREADS in attention.cu).
const ATTENTION_THREADS: u32 = 256;
/// The most blocks of the one-pass kernel that share a head's context (ATTN_MAX_SPLITS).
const ATTENTION_MAX_SPLITS: usize = 8;
/// The largest head the attention kernels take.
const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Warps of a flash-attention block on mma.sync (FA_WARPS in flash_attention.cu).
const FLASH_WARPS: usize = 4;
/// Keys per step of flash attention on mma.sync (FA_KEYS) and on the warpgroup MMAs (FW_KEYS).
const FLASH_KEYS: usize = 32;
const FLASH_WG_KEYS: usize = 64;
/// Query rows of a group of a flash-attention block: a warpgroup's, or a 16 each of four warps.
const FLASH_GROUP_ROWS: usize = 64;
/// The most rotated pairs of a head flash attention takes (heads of at most 128).
const FLASH_MAX_PAIRS: usize = 64;
/// Heads per block of rope_kv_write.cu in steps of few tokens, so that a decode step's heads
/// spread over blocks (one pair a thread); steps of `FLASH_MIN_TOKENS` or more take each token's
/// heads in one block, which computes their angles once for all of them.
const ROPE_HEADS: usize = 4;
/// The most rotated pairs of a head (rope_kv_write.cu).
const ROPE_MAX_PAIRS: usize = 128;
/// The most float4 a thread of the RMS norms holds (NORM_LOADS in rms_norm.cu).
const NORM_LOADS: usize = 4;
/// The largest second grid dimension CUDA launches.
const MAX_GRID_Y: u32 = 65535;

/// How flash attention is cut into blocks of `groups` times 64 query rows. On Hopper (sm_90a)
/// each group is a warpgroup of its own on the warpgroup MMAs (flash_attention_wg.cu);
/// elsewhere the four warps of a block each take `groups` groups of 16 rows on mma.sync
/// (flash_attention.cu), where two share every key and value fragment a warp loads (half the
/// fragment loads and about a quarter fewer instructions an MMA). Either way blocks of 128
/// queries are too few to fill the GPU in short steps, which take blocks of one group.
#[derive(Clone, Copy)]
struct FlashBlocks {
    head_dim: usize,
    groups: usize,
    warpgroups: bool,
}

impl FlashBlocks {
    /// Two groups where the step's tiles of 128 queries give each multiprocessor two blocks.
    fn for_step(shape: AttentionShape, n_tokens: usize, multiprocessors: u32, warpgroups: bool) -> FlashBlocks {
        let wide_blocks = n_tokens.div_ceil(2 * FLASH_GROUP_ROWS) * shape.n_heads;
        FlashBlocks {
            head_dim: shape.head_dim,
            groups: if wide_blocks >= 2 * multiprocessors as usize {
                2
            } else {
                1
            },
            warpgroups,
        }
    }

    fn kernel(&self) -> String {
        kernels::flash_attention_kernel(self.head_dim, self.groups, self.warpgroups)
    }

    /// Query tokens a block takes.
    fn tile(&self) -> usize {
        FLASH_GROUP_ROWS * self.groups
    }

    fn threads(&self) -> u32 {
        if self.warpgroups {
            (self.groups * 128) as u32
        } else {
            (FLASH_WARPS * 32) as u32
        }
    }

    /// A block's dynamic shared memory: two buffers of keys, two of values and the block's
    /// queries, in f16: on mma.sync each row of `head_dim` padded by 16 bytes; on the warpgroup
    /// MMAs swizzled, with 1024 bytes more to align the tiles.
    fn shared(&self) -> u32 {
        let bytes = if self.warpgroups {
            (4 * FLASH_WG_KEYS + self.tile()) * self.head_dim * 2 + 1024
        } else {
            (4 * FLASH_KEYS + self.tile()) * (self.head_dim + 8) * 2
        };
        bytes as u32
    }
}

/// Splits a step's tokens into runs of one sequence at consecutive positions, at most `tile`
/// long: `(first token, count)` pairs, flattened, for flash_attention.cu.
fn query_tiles(positions: &[u32], token_seqs: &[u32], tile: usize) -> Vec<u32> {
    let mut tiles: Vec<u32> = Vec::new();
    for t in 0..positions.len() {
        let extends = t > 0
            && token_seqs[t] == token_seqs[t - 1]
            && positions[t] == positions[t - 1] + 1
            && tiles.last().is_some_and(|&n| (n as usize) < tile);
        match tiles.last_mut() {
            Some(n) if extends => *n += 1,
            _ => tiles.extend([t as u32, 1]),
        }
    }
    tiles
}

/// A weight matrix in device memory, in its stored type, split by field (see `split_weight`):
/// quants in `q`, per-block scales or K-quant metadata in `s`, minimums or Q6_K high bits in `m`.
pub struct CudaWeight {
    pub ty: GgmlType,
    pub n_out: usize,
    pub n_in: usize,
    q: BlockHandle,
    s: Option<BlockHandle>,
    m: Option<BlockHandle>,
}
super::impl_matrix!(CudaWeight);

/// A weight's fields in the split layout the kernels read (kernels/dequant.cuh): every row's
/// quants contiguous, so a lane loads 16 or 32 aligned bytes at once (Q4_K's interleaved:
/// `interleave_row`), and the small per-block fields in side arrays. Float weights stay as they
/// are.
struct SplitWeight {
    q: Vec<u8>,
    s: Vec<u8>,
    m: Vec<u8>,
}

fn split_weight(ty: GgmlType, bytes: &[u8], n_in: usize) -> SplitWeight {
    let (mut q, mut s, mut m) = (Vec::with_capacity(bytes.len()), Vec::new(), Vec::new());
    let blocks = bytes.chunks_exact(ty.block_bytes());
    match ty {
        GgmlType::Q8_0 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            q.extend_from_slice(&b[2..34]);
        }),
        GgmlType::Q4_0 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            q.extend_from_slice(&b[2..18]);
        }),
        GgmlType::Q4_1 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            m.extend_from_slice(&b[2..4]);
            q.extend_from_slice(&b[4..20]);
        }),
        GgmlType::Q4K => {
            let mut row = Vec::with_capacity(n_in / 2);
            for row_blocks in bytes.chunks_exact(n_in / 256 * ty.block_bytes()) {
                row.clear();
                for b in row_blocks.chunks_exact(ty.block_bytes()) {
                    s.extend_from_slice(&b[0..16]);
                    row.extend_from_slice(&b[16..144]);
                }
                interleave_row(&row, Q4K_GROUP_BYTES, &mut q);
            }
        }
        GgmlType::Q6K => blocks.for_each(|b| {
            q.extend_from_slice(&b[0..128]);
            m.extend_from_slice(&b[128..192]);
            s.extend_from_slice(&b[192..210]);
            s.extend_from_slice(&[0, 0]);
        }),
        _ => q.extend_from_slice(bytes),
    }
    SplitWeight { q, s, m }
}

/// Rows a warp of the one-token Q4_K integer matrix-vector kernel takes (as Q4K_ROWS in
/// kernels/matmul.cu).
const Q4K_ROWS: usize = 2;

/// Units per tile of the interleaved layout (INTERLEAVE_UNITS in kernels/common.cuh).
const INTERLEAVE_UNITS: usize = 8;
/// A Q4_K lane's unit of quants: 32 bytes, two sub-blocks.
const Q4K_GROUP_BYTES: usize = 32;

/// Appends a row of units of `unit_bytes` (a multiple of 16) in the interleaved order of
/// kernels/common.cuh: tiles of `INTERLEAVE_UNITS` units, each stored 16-byte piece by piece.
fn interleave_row(row: &[u8], unit_bytes: usize, out: &mut Vec<u8>) {
    for tile in row.chunks(unit_bytes * INTERLEAVE_UNITS) {
        for piece in (0..unit_bytes).step_by(16) {
            for unit in tile.chunks_exact(unit_bytes) {
                out.extend_from_slice(&unit[piece..piece + 16]);
            }
        }
    }
}

/// Whether the integer kernels for `ty` take their activations interleaved (`q8_slot` in
/// kernels/common.cuh): Q4_K's, whose lanes take 64 values each. Their scales then come with each
/// block's sum (`store_q8_scale`).
fn interleaves_activations(ty: GgmlType) -> bool {
    ty == GgmlType::Q4K
}

/// Bytes of block scales for `n` activations quantized for `ty`'s integer kernels: an f32 per 32
/// values, and for interleaved ones the block's sum beside it.
fn q8_scale_bytes(ty: GgmlType, n: usize) -> usize {
    let per_block = if interleaves_activations(ty) { 8 } else { 4 };
    n / 32 * per_block
}

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
    /// What `flash_tiles` holds the tiles of, for the layers after the first of a step. Every
    /// `write_u32`, which is how a multi-token step's positions and sequences arrive, forgets it.
    /// (A greedy step's position, which the argmax advances on the device, is one token's: it
    /// never takes flash attention.)
    flash_plan: Cell<Option<FlashPlan>>,
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
        // SAFETY: only probes for the shared library.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(Error::Backend("cuBLAS (libcublas.so) is not installed".into()));
        }
        let blas = cublas::create_handle().map_err(|e| Error::Backend(format!("cuBLAS: {e:?}")))?;
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
            flash_plan: Cell::new(None),
            int8_activations: None,
            largest_weight: 0,
            graphs: RefCell::new(Vec::new()),
            argmax_state: 0,
            attention_partials: 0,
            q4k_spread,
            quantize_padding,
            flash_head_dims,
            flash_warpgroups,
            flash_fixed: None,
            capture_max_tokens: GEMV_MAX_TOKENS,
            kv_type: KvType::F16,
        })
    }

    /// Chooses the KV cache's element type (f16 by default).
    pub fn with_kv_type(mut self, kv_type: KvType) -> CudaBackend {
        self.kv_type = kv_type;
        self
    }

    /// Fixes flash attention's blocks: `groups` groups of 64 query rows (1 or 2), on the
    /// warpgroup MMAs or on mma.sync, instead of the backend's choice by the step's size and the
    /// device (`FlashBlocks::for_step`), so that every kernel can be tested and measured on any
    /// step.
    pub fn with_flash_kernel(mut self, groups: usize, warpgroups: bool) -> Result<CudaBackend> {
        if !matches!(groups, 1 | 2) {
            return Err(Error::Backend(format!(
                "flash attention takes 1 or 2 groups of 64 query rows a block, not {groups}"
            )));
        }
        if !self.flash_attention_kinds().contains(&warpgroups) {
            return Err(Error::Backend(format!(
                "no warpgroup MMAs on {} (they need sm_90a)",
                self.device.arch
            )));
        }
        self.flash_fixed = Some((groups, warpgroups));
        Ok(self)
    }

    /// The flash-attention kernels this device has, by whether they run on the warpgroup MMAs.
    pub fn flash_attention_kinds(&self) -> &'static [bool] {
        kernels::flash_attention_kinds(self.device.arch)
    }

    fn kv_suffix(&self) -> &'static str {
        match self.kv_type {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }

    fn ptr(&self, block: BlockHandle) -> u64 {
        self.base + block.offset as u64
    }

    /// Device pointers of a weight's three fields (0 for a field it does not have).
    fn weight_ptrs(&self, w: &CudaWeight) -> (u64, u64, u64) {
        let field = |b: Option<BlockHandle>| b.map_or(0, |b| self.ptr(b));
        (self.ptr(w.q), field(w.s), field(w.m))
    }

    /// `argmax` of `rows` rows (at most ARGMAX_ROWS) at device addresses, the indices also to
    /// `chosen` where it is not 0; a greedy choice's (`next`) writes its position too.
    fn launch_argmax(
        &self,
        x: u64,
        out: u64,
        rows: usize,
        width: usize,
        chosen: u64,
        next: Option<NextInput>,
    ) -> Result<()> {
        let n = i32::try_from(width)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("argmax over {width} values")))?;
        let keys = self.argmax_state;
        let arrivals = keys + (ARGMAX_ROWS * 8) as u64;
        let (chosen_at, position) = next.map_or((0, 0), |n| (self.ptr(n.chosen_at), self.ptr(n.position)));
        self.launch(
            "argmax",
            (width.div_ceil(ARGMAX_PER_BLOCK) as u32, rows as u32, 1),
            ARGMAX_THREADS,
            &[&x, &n, &out, &chosen, &chosen_at, &position, &keys, &arrivals],
        )
    }

    fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, args: &[&dyn KernelArg]) -> Result<()> {
        self.launch_shared(name, grid, block, 0, args)
    }

    fn launch_shared(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[&dyn KernelArg],
    ) -> Result<()> {
        let f = self.kernels.get(name)?.cu_function();
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
        // Every kernel waits for its inputs itself (begin_after_inputs in common.cuh), so each may
        // be scheduled while the one before is finishing.
        let mut overlap = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.device.dependent_launch),
        };
        // SAFETY: every kernel's argument list matches its `extern "C"` signature (see kernels/),
        // pointers are arena blocks sized by the caller's checked shapes; `params` and `overlap`
        // outlive the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(driver_error(name))
    }

    fn type_suffix(ty: GgmlType) -> Result<&'static str> {
        super::gpu_kernel_suffix(ty).ok_or_else(|| Error::UnsupportedTensorType {
            name: String::new(),
            ty: ty.to_string(),
            op: "the CUDA backend",
        })
    }

    /// `out = x w^T` through cuBLAS, stored or added as `output` says. Its 16-bit input is
    /// staged: `staged` says which type the staging already holds `x` in, so the weights that
    /// share an input convert it once.
    fn gemm(
        &self,
        x: BlockHandle,
        w: &CudaWeight,
        out: BlockHandle,
        n_tokens: usize,
        output: GemmOutput,
        staged: &mut Option<GgmlType>,
    ) -> Result<()> {
        let (n_in, n_out) = (w.n_in, w.n_out);
        let (w_stage, x_stage) = self.cublas_staging()?;
        // Float weights are read as they are; quantized ones are dequantized to f16 first.
        let input = gemm_input(w.ty);
        let a = if input == w.ty {
            self.ptr(w.q)
        } else {
            let name = format!("dequant_f16_{}", Self::type_suffix(w.ty)?);
            let chunks = n_out * n_in / 32;
            let (q, s, m) = self.weight_ptrs(w);
            let (n_in_i, n_out_i) = (n_in as i32, n_out as i32);
            self.launch(
                &name,
                (blocks_for(chunks, 256), 1, 1),
                256,
                &[&q, &s, &m, &n_in_i, &self.ptr(w_stage), &n_out_i],
            )?;
            self.ptr(w_stage)
        };
        let b = if input == GgmlType::F32 {
            self.ptr(x)
        } else {
            if *staged != Some(input) {
                let (n, kind) = ((n_tokens * n_in) as u64, input.id() as i32);
                self.launch(
                    "convert_f32",
                    (blocks_for(n.div_ceil(4) as usize, 256), 1, 1),
                    256,
                    &[&self.ptr(x), &self.ptr(x_stage), &n, &kind],
                )?;
                *staged = Some(input);
            }
            self.ptr(x_stage)
        };
        let data_type = match input {
            GgmlType::F32 => cublas_sys::cudaDataType_t::CUDA_R_32F,
            GgmlType::F16 => cublas_sys::cudaDataType_t::CUDA_R_16F,
            _ => cublas_sys::cudaDataType_t::CUDA_R_16BF,
        };
        let out_type = match output {
            GemmOutput::Store16 if input != GgmlType::F32 => data_type,
            GemmOutput::Store16 => return Err(Error::Backend("a 16-bit product of f32 weights".into())),
            _ => cublas_sys::cudaDataType_t::CUDA_R_32F,
        };
        let (alpha, beta) = (1.0f32, if output == GemmOutput::Add { 1.0f32 } else { 0.0 });
        // Row-major out[t][o] = sum_i x[t][i] w[o][i] is, column-major, C(n_out x n_tokens) =
        // W^T(n_out x n_in) X(n_in x n_tokens), with W stored as a column-major n_in x n_out.
        // SAFETY: pointers are arena blocks holding these shapes; the handle is bound to our stream.
        unsafe {
            cublas::gemm_ex(
                self.blas,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n_out as i32,
                n_tokens as i32,
                n_in as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                data_type,
                n_in as i32,
                b as *const _,
                data_type,
                n_in as i32,
                &beta as *const f32 as *const _,
                self.ptr(out) as *mut _,
                out_type,
                n_out as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Backend(format!("cuBLAS GEMM: {e:?}")))
    }

    /// The kernel argument for `ws` (one type, at most `MAX_MATRICES`), writing token rows
    /// `first..first + count` of `outs` (with `Epilogue::SwiGlu`, ws is gate and up, and outs one
    /// output); and the blocks their rows need, a warp taking `rows_per_warp` rows of a matrix.
    fn matrices(
        &self,
        ws: &[&CudaWeight],
        outs: &[BlockHandle],
        epilogue: Epilogue,
        (first, count): (usize, usize),
        rows_per_warp: usize,
    ) -> (Matrices, u32) {
        let mut m = Matrices {
            count: ws.len() as i32,
            accumulate: i32::from(epilogue == Epilogue::Add),
            ..Matrices::default()
        };
        for (i, (w, out)) in ws.iter().zip(outs.iter().cycle()).enumerate() {
            (m.q[i], m.s[i], m.m[i]) = self.weight_ptrs(w);
            m.n_out[i] = w.n_out as i32;
            m.out[i] = self.ptr(out.slice(first * w.n_out * 4, count * w.n_out * 4));
        }
        // Eight warps per block. With SwiGLU a warp of several rows takes gate rows and the same up
        // rows, and warps of one row pair up (gemv_rows in matmul.cu): 4 * rows_per_warp outputs a
        // block either way.
        let blocks = match epilogue {
            Epilogue::SwiGlu => ws[0].n_out.div_ceil(4 * rows_per_warp),
            _ => ws
                .iter()
                .map(|w| w.n_out.div_ceil(rows_per_warp))
                .sum::<usize>()
                .div_ceil(8),
        };
        (m, blocks as u32)
    }

    /// The matrix-vector kernels for `ws` (one type, at most `MAX_MATRICES`; with
    /// `Epilogue::SwiGlu`, gate and up) in groups of up to 8 tokens: on int8 activations for the
    /// weights that take them, quantized (and normalized) here unless `quantized` already holds
    /// them in the layout they read, else on the f32 rows.
    fn gemv(
        &self,
        x: Input,
        ws: &[&CudaWeight],
        outs: &[BlockHandle],
        n_tokens: usize,
        epilogue: Epilogue,
        quantized: &mut Option<Quantized>,
    ) -> Result<()> {
        let w = ws[0];
        let suffix = Self::type_suffix(w.ty)?;
        let n_in = w.n_in as i32;
        let input = match self.int8_activations.filter(|_| self.takes_int8(w)) {
            Some(staging) => GemvInput::Int8(match *quantized {
                Some(q) if q.interleaved == interleaves_activations(w.ty) => q,
                _ => *quantized.insert(self.quantize_activations(x, staging, n_tokens, w)?),
            }),
            None => match x {
                Input::RmsNormed { x, weight, eps, .. } if self.gemv_normalizes(w, n_tokens) => {
                    GemvInput::Normed { x, weight, eps }
                }
                _ => GemvInput::F32(self.input_rows(x, n_tokens, w.n_in)?),
            },
        };
        let glu = epilogue == Epilogue::SwiGlu;
        for (done, t) in token_groups(n_tokens) {
            // Q4_K's one-token integer kernels take two rows a warp and spread their blocks.
            let q4k_one_token = matches!(input, GemvInput::Int8(_)) && w.ty == GgmlType::Q4K && t == 1;
            let rows_per_warp = if q4k_one_token { Q4K_ROWS } else { 1 };
            let (mut mats, blocks) = self.matrices(ws, outs, epilogue, (done, t), rows_per_warp);
            match input {
                GemvInput::Int8(Quantized {
                    xq,
                    xd,
                    by_quiet_kernel,
                    ..
                }) => {
                    mats.copy_whole = i32::from(by_quiet_kernel);
                    let xqs = self.ptr(xq.slice(done * w.n_in, t * w.n_in));
                    let scale_bytes = q8_scale_bytes(w.ty, w.n_in);
                    let xds = self.ptr(xd.slice(done * scale_bytes, t * scale_bytes));
                    let name = kernels::gemv_kernel(true, glu, suffix, t);
                    let shared = match &self.q4k_spread {
                        Some(spread) if q4k_one_token => spread[usize::from(glu)].padding(blocks),
                        _ => 0,
                    };
                    self.launch_shared(&name, (blocks, 1, 1), 256, shared, &[&mats, &n_in, &xqs, &xds])?
                }
                GemvInput::F32(rows) => {
                    let xs = self.ptr(rows.slice(done * w.n_in * 4, t * w.n_in * 4));
                    let name = kernels::gemv_kernel(false, glu, suffix, t);
                    self.launch(&name, (blocks, 1, 1), 256, &[&mats, &n_in, &xs])?
                }
                GemvInput::Normed { x, weight, eps } => {
                    let name = kernels::gemv_normed_kernel(glu, suffix);
                    let (x, weight) = (self.ptr(x), self.ptr(weight));
                    self.launch(&name, (blocks, 1, 1), 256, &[&mats, &n_in, &x, &weight, &eps])?
                }
            }
        }
        Ok(())
    }

    /// `Backend::attention`; with `quantized_for`, the one-pass kernel also writes its output into
    /// that staging as `quantize_activations` would for that weight (the head size then a multiple
    /// of 32). With `new`, a step of one token also rotates the query and the new key and stores
    /// the token's cache row, as `rope_kv_write` would before it; a flash-attention step rotates
    /// its queries, whose keys `rotate_and_store` has stored with their angles.
    fn attend(
        &self,
        q: BlockHandle,
        new: Option<NewRows>,
        kv: AttentionKv,
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
        let (k_new, v_new, freqs, (dims, halves)) = match new {
            Some(new) => (
                self.ptr(new.k),
                self.ptr(new.v),
                self.ptr(new.freqs),
                rope_args(new.rope)?,
            ),
            None => (0, 0, 0, (0, 0)),
        };
        let AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
        } = kv;
        let (nh, nkv, hd) = (shape.n_heads as i32, shape.n_kv_heads as i32, shape.head_dim as i32);
        let (table_width, page_size) = (pages.table_width as i32, page_size_arg(&pages)?);
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
        // Where the step's heads leave multiprocessors idle, several blocks share each head's
        // context (heads times splits at most the multiprocessors: their states fit past the
        // arena).
        let heads = n_tokens * shape.n_heads;
        let splits = (self.device.multiprocessors as usize / heads).clamp(1, ATTENTION_MAX_SPLITS);
        self.launch(
            &format!("attention_{}", self.kv_suffix()),
            (n_tokens as u32, shape.n_heads as u32, splits as u32),
            ATTENTION_THREADS,
            &[
                &self.ptr(q),
                &self.ptr(k_cache),
                &self.ptr(v_cache),
                &self.ptr(positions),
                &self.ptr(pages.block_tables),
                &table_width,
                &self.ptr(pages.token_seqs),
                &page_size,
                &k_new,
                &v_new,
                &freqs,
                &dims,
                &halves,
                &self.ptr(out),
                &xq,
                &xd,
                &interleave,
                &start_next,
                &self.attention_partials,
                &nh,
                &nkv,
                &hd,
            ],
        )
    }

    /// Where the output projection runs on integers (decode of a quantized `wo`), the one-pass
    /// attention kernel quantizes its output for it as it writes it: no launch of its own. Where
    /// it runs through cuBLAS after flash attention (prefill), attention writes its 16-bit input.
    /// `new` as for `attend`.
    #[allow(clippy::too_many_arguments)]
    fn attend_then_project(
        &self,
        q: BlockHandle,
        new: Option<NewRows>,
        kv: AttentionKv,
        wo: &CudaWeight,
        [out, residual, scratch]: [BlockHandle; 3],
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let input = gemm_input(wo.ty);
        if self.takes_flash(shape, n_tokens) && n_tokens > gemv_max_tokens(wo.ty) && input != GgmlType::F32 {
            // Flash attention writes its output in the 16-bit type cuBLAS reads, straight into the
            // staging: no f32 round trip and no conversion pass.
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
            return self.gemm(out, wo, residual, n_tokens, GemmOutput::Add, &mut Some(input));
        }
        let folds = n_tokens <= gemv_max_tokens(wo.ty)
            && self.takes_int8(wo)
            && !self.takes_flash(shape, n_tokens)
            && shape.head_dim.is_multiple_of(32);
        match self.int8_activations.filter(|_| folds) {
            Some(staging) => {
                self.attend(q, new, kv, out, Some((staging, wo)), n_tokens, shape)?;
                let (xq, xd) = staging;
                let quantized = Quantized {
                    xq,
                    xd,
                    interleaved: interleaves_activations(wo.ty),
                    by_quiet_kernel: n_tokens == 1,
                };
                self.gemv(
                    out.into(),
                    &[wo],
                    &[residual],
                    n_tokens,
                    Epilogue::Add,
                    &mut Some(quantized),
                )
            }
            None => {
                self.attend(q, new, kv, out, None, n_tokens, shape)?;
                self.matmul_add(out, wo, residual, scratch, n_tokens)
            }
        }
    }

    /// Attention on tensor cores (flash_attention.cu), its output written at `out` as `out_type`:
    /// f32, or f16 or bf16 for a cuBLAS GEMM to read. With `rotate` (of whole heads), the queries
    /// are rotated as they are loaded, by the angles `rotate_and_store` left in `flash_turns`.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention(
        &self,
        q: BlockHandle,
        rotate: Option<Rope>,
        AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
        }: AttentionKv,
        out: u64,
        out_type: GgmlType,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let tiles_block = self
            .flash_tiles
            .ok_or_else(|| Error::Backend("no flash-attention tiles reserved".into()))?;
        let blocks = match self.flash_fixed {
            Some((groups, warpgroups)) => FlashBlocks {
                head_dim: shape.head_dim,
                groups,
                warpgroups,
            },
            None => FlashBlocks::for_step(shape, n_tokens, self.device.multiprocessors, self.flash_warpgroups),
        };
        let tile = blocks.tile();
        let n_tiles = match self.flash_plan.get() {
            Some(plan)
                if (plan.positions, plan.token_seqs, plan.n_tokens, plan.tile)
                    == (positions, pages.token_seqs, n_tokens, tile) =>
            {
                plan.n_tiles
            }
            _ => {
                // The step's layout comes back to the host to be cut into tiles, once a step: a
                // prefill step is not recorded into a graph, and the copies wait for all the work
                // before them.
                let (mut host_positions, mut host_seqs) = (vec![0u32; n_tokens], vec![0u32; n_tokens]);
                self.read_u32(positions, &mut host_positions)?;
                self.read_u32(pages.token_seqs, &mut host_seqs)?;
                let tiles = query_tiles(&host_positions, &host_seqs, tile);
                let n_tiles = u32::try_from(tiles.len() / 2)
                    .ok()
                    .filter(|&n| n <= MAX_GRID_Y)
                    .ok_or_else(|| Error::Backend(format!("{n_tokens} tokens make too many attention tiles")))?;
                self.write_u32(tiles_block, &tiles)?;
                self.flash_plan.set(Some(FlashPlan {
                    positions,
                    token_seqs: pages.token_seqs,
                    n_tokens,
                    tile,
                    n_tiles,
                }));
                n_tiles
            }
        };
        let (nh, nkv) = (shape.n_heads as i32, shape.n_kv_heads as i32);
        let (table_width, page_size) = (pages.table_width as i32, page_size_arg(&pages)?);
        // How the kernel pairs the dimensions it rotates (FA_ADJACENT, FA_HALVES).
        let (turns, pairing) = match rotate {
            Some(rope) if rope.dims == shape.head_dim => {
                let turns = self
                    .flash_turns
                    .ok_or_else(|| Error::Backend("no flash-attention angles reserved".into()))?;
                (self.ptr(turns), 1 + i32::from(rope.layout == RopeLayout::Halves))
            }
            Some(rope) => {
                return Err(Error::Backend(format!(
                    "flash attention rotates whole heads, not {} of {}",
                    rope.dims, shape.head_dim
                )))
            }
            None => (0, 0),
        };
        // Heads first, then tiles: the kernel takes the tiles from the last (see
        // flash_attention.cu).
        self.launch_shared(
            &blocks.kernel(),
            (shape.n_heads as u32, n_tiles, 1),
            blocks.threads(),
            blocks.shared(),
            &[
                &self.ptr(q),
                &self.ptr(k_cache),
                &self.ptr(v_cache),
                &self.ptr(positions),
                &self.ptr(pages.block_tables),
                &table_width,
                &self.ptr(pages.token_seqs),
                &page_size,
                &self.ptr(tiles_block),
                &turns,
                &pairing,
                &out,
                &(out_type.id() as i32),
                &nh,
                &nkv,
            ],
        )
    }

    /// `rope_kv_write`; with `turns` (a flash-attention step), only the keys are rotated, into
    /// the cache and not back, and each token's angles go to `turns` for flash attention to rotate
    /// the queries with as it loads them: 67 MB a layer less to move for the 8B at 2048 tokens.
    fn rotate_and_store(
        &self,
        new: NewRows,
        kv: AttentionKv,
        n_tokens: usize,
        shape: AttentionShape,
        turns: Option<BlockHandle>,
    ) -> Result<()> {
        let (nh, nkv, hd) = (shape.n_heads as i32, shape.n_kv_heads as i32, shape.head_dim as i32);
        let (table_width, page_size) = (kv.pages.table_width as i32, page_size_arg(&kv.pages)?);
        let (dims, halves) = rope_args(new.rope)?;
        let heads = shape.n_heads + shape.n_kv_heads;
        let (first_head, group) = match turns {
            Some(_) => (shape.n_heads, shape.n_kv_heads),
            None if n_tokens >= FLASH_MIN_TOKENS => (0, heads),
            None => (0, ROPE_HEADS),
        };
        let groups = (heads - first_head).div_ceil(group);
        self.launch(
            &format!("rope_kv_write_{}", self.kv_suffix()),
            (n_tokens as u32, groups as u32, 1),
            256,
            &[
                &self.ptr(new.q),
                &self.ptr(new.k),
                &self.ptr(new.v),
                &self.ptr(kv.k_cache),
                &self.ptr(kv.v_cache),
                &self.ptr(kv.positions),
                &self.ptr(new.freqs),
                &self.ptr(kv.pages.block_tables),
                &table_width,
                &self.ptr(kv.pages.token_seqs),
                &page_size,
                &nh,
                &nkv,
                &hd,
                &dims,
                &halves,
                &(first_head as i32),
                &(group as i32),
                &turns.map_or(0, |t| self.ptr(t)),
            ],
        )
    }

    /// Whether attention over `n_tokens` runs on tensor cores (flash_attention.cu).
    fn takes_flash(&self, shape: AttentionShape, n_tokens: usize) -> bool {
        self.kv_type == KvType::F16
            && self.flash_head_dims.contains(&shape.head_dim)
            && n_tokens >= FLASH_MIN_TOKENS
            && self.flash_tiles.is_some()
    }

    /// Whether the matrix-vector kernels for `w` normalize an `Input::RmsNormed` themselves: the
    /// integer ones as they quantize it; the f32 ones for one token of a small matrix (see
    /// `NORMED_GEMV_MAX_VALUES`). (Their float4 reads need rows of a multiple of 4 values;
    /// `upload_weight` admits only multiples of 32.)
    fn gemv_normalizes(&self, w: &CudaWeight, n_tokens: usize) -> bool {
        let small = w.n_in * w.n_out <= NORMED_GEMV_MAX_VALUES && w.n_in <= kernels::GEMV_NORMED_MAX_IN;
        self.takes_int8(w) || (n_tokens == 1 && small)
    }

    /// Whether `w` is multiplied on integers at decode (see `INT_GEMV_MIN_N_IN`).
    fn takes_int8(&self, w: &CudaWeight) -> bool {
        let large = w.n_in >= INT_GEMV_MIN_N_IN || w.n_in * w.n_out >= INT_GEMV_MIN_VALUES;
        self.int8_activations.is_some() && w.ty.block_len() > 1 && large
    }

    /// The 16-bit staging cuBLAS reads from: (a dequantized weight, the converted activations).
    fn cublas_staging(&self) -> Result<(BlockHandle, BlockHandle)> {
        self.staging
            .ok_or_else(|| Error::Backend("no cuBLAS staging reserved".into()))
    }

    /// The rows `gemm` takes for `x`. An `Input::RmsNormed` is normalized straight into the 16-bit
    /// staging as `ty`, and `staged` then says so: the handle returned is its scratch, standing in
    /// for f32 rows that `gemm` finds staged and does not read.
    fn stage_16bit(
        &self,
        x: Input,
        n_tokens: usize,
        dim: usize,
        ty: GgmlType,
        staged: &mut Option<GgmlType>,
    ) -> Result<BlockHandle> {
        match x {
            Input::Rows(rows) => Ok(rows),
            Input::RmsNormed {
                x,
                weight,
                eps,
                scratch,
            } => {
                self.rms_norm_16bit(x, weight, eps, n_tokens, dim, ty)?;
                *staged = Some(ty);
                Ok(scratch)
            }
        }
    }

    /// RMS-normalizes `n_tokens` rows of `dim` into the cuBLAS activation staging, as `ty` (f16 or
    /// bf16). `dim` is a weight's row length, so a multiple of 32, as the kernel's float4 reads
    /// need.
    fn rms_norm_16bit(
        &self,
        x: BlockHandle,
        weight: BlockHandle,
        eps: f32,
        n_tokens: usize,
        dim: usize,
        ty: GgmlType,
    ) -> Result<()> {
        let (_, x_stage) = self.cublas_staging()?;
        if n_tokens * dim * 2 > x_stage.len {
            return Err(Error::Backend(format!(
                "{n_tokens} x {dim} activations exceed the cuBLAS staging of {} bytes",
                x_stage.len
            )));
        }
        self.launch(
            "rms_norm_16",
            (n_tokens as u32, 1, 1),
            norm_block(dim, NORM_LOADS)?,
            &[
                &self.ptr(x),
                &self.ptr(weight),
                &self.ptr(x_stage),
                &(dim as i32),
                &eps,
                &(ty.id() as i32),
            ],
        )
    }

    /// Quantizes `n_tokens` rows of activations for `w` into `staging` (int8 values, f32 scale
    /// per 32) in the layout `w`'s kernels read, normalizing them first if `x` says so.
    fn quantize_activations(
        &self,
        x: Input,
        (xq, xd): (BlockHandle, BlockHandle),
        n_tokens: usize,
        w: &CudaWeight,
    ) -> Result<Quantized> {
        let n_in = w.n_in;
        let n = n_tokens * n_in;
        if n > xq.len {
            return Err(Error::Backend(format!(
                "{n} activations exceed the int8 staging of {}",
                xq.len
            )));
        }
        let (xq_ptr, xd_ptr) = (self.ptr(xq), self.ptr(xd));
        let interleaved = interleaves_activations(w.ty);
        let (interleave, start_next) = (i32::from(interleaved), i32::from(starts_next_early(w.ty)));
        match x {
            Input::Rows(x) => {
                let blocks = blocks_for(n / 4, 256);
                let padding = if w.ty == GgmlType::Q4K && blocks <= self.device.multiprocessors {
                    self.quantize_padding
                } else {
                    0
                };
                self.launch_shared(
                    "quantize_q8",
                    (blocks, 1, 1),
                    256,
                    padding,
                    &[
                        &self.ptr(x),
                        &xq_ptr,
                        &xd_ptr,
                        &(n as u64),
                        &(n_in as i32),
                        &interleave,
                        &start_next,
                    ],
                )?
            }
            Input::RmsNormed { x, weight, eps, .. } => {
                let (kernel, threads) = norm_q8_kernel(n_in)?;
                self.launch(
                    kernel,
                    (n_tokens as u32, 1, 1),
                    threads,
                    &[
                        &self.ptr(x),
                        &self.ptr(weight),
                        &xq_ptr,
                        &xd_ptr,
                        &(n_in as i32),
                        &eps,
                        &interleave,
                        &start_next,
                    ],
                )?
            }
        }
        Ok(Quantized {
            xq,
            xd,
            interleaved,
            by_quiet_kernel: false,
        })
    }
}

/// A kernel whose grids smaller than what the GPU holds at once are spread evenly over the
/// multiprocessors: launched with unused dynamic shared memory enough that a multiprocessor holds
/// no more of its blocks than an even spread gives each. Left to itself the GPU places such a grid
/// on fewer multiprocessors, each streaming more of the weights (as wo's and down's blocks did).
#[derive(Clone, Copy)]
struct EvenSpread {
    multiprocessors: u32,
    /// Blocks a multiprocessor holds without padding.
    blocks_per_multiprocessor: u32,
    /// The kernel's own shared memory, a multiprocessor's, and what each block reserves besides.
    kernel_shared: u32,
    multiprocessor_shared: u32,
    reserved_shared: u32,
}

impl EvenSpread {
    fn new(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<Option<EvenSpread>> {
        use sys::CUdevice_attribute as A;
        let (multiprocessor_shared, reserved_shared) = (
            device.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            device.attribute(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
        );
        let kernel_shared = kernel_shared(f)?;
        if multiprocessor_shared < 2 * (kernel_shared + reserved_shared) {
            return Ok(None);
        }
        allow_dynamic_shared(device, f)?;
        let blocks_per_multiprocessor = f
            .occupancy_max_active_blocks_per_multiprocessor(256, 0, None)
            .map_err(driver_error("occupancy"))?;
        Ok(Some(EvenSpread {
            multiprocessors: device.multiprocessors,
            blocks_per_multiprocessor,
            kernel_shared,
            multiprocessor_shared,
            reserved_shared,
        }))
    }

    /// The dynamic shared memory for a launch of `blocks`: enough that no multiprocessor can hold
    /// more than its even share of them, or none where the grid fills the GPU anyway.
    fn padding(&self, blocks: u32) -> u32 {
        let share = blocks.div_ceil(self.multiprocessors).max(1);
        if share >= self.blocks_per_multiprocessor {
            return 0;
        }
        // share + 1 blocks of this size overflow the multiprocessor's shared memory.
        let block = self.multiprocessor_shared / (share + 1) + 1;
        (block - self.reserved_shared).saturating_sub(self.kernel_shared)
    }
}

/// Asks the driver to give the multiprocessors that run `f` the most of their L1 as shared memory
/// (the carveout), for kernels such as Q4_K's one-token gate/up, whose four blocks a
/// multiprocessor the driver would otherwise not fit. Set on every kernel, it slows the others.
fn prefer_shared_memory(f: &cudarc::driver::CudaFunction) -> Result<()> {
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_MAX_SHARED as i32,
    )
    .map_err(driver_error("kernel attribute"))
}

/// The shared memory a small launch of quantize_q8 (the down projection's input in decode: 14
/// blocks for the 8B) asks for and leaves unused: half a multiprocessor's, so that each block has
/// a multiprocessor to itself but for at most two of the products' blocks. Gate/up starts it
/// early (`start_dependents` in common.cuh), and its blocks were placed beside gate/up's last ones
/// and then down's first ones, competing with them. Q8_0's decode (one row a warp) does not gain
/// by it, so it is Q4_K's only. 0 where the device cannot give it.
fn quantize_padding(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<u32> {
    let half =
        device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? / 2 + 1;
    Ok(if half <= allow_dynamic_shared(device, f)? {
        half
    } else {
        0
    })
}

/// The head sizes flash attention takes on this device (64 and 128 where a block may have their
/// shared memory: not on compute capability 7.5), each kernel allowed its dynamic shared memory.
fn flash_head_dims(device: &CudaDevice, kernels: &Kernels) -> Result<Vec<usize>> {
    let mut dims = Vec::new();
    for head_dim in [64, 128] {
        let mut fits = true;
        for &warpgroups in kernels::flash_attention_kinds(device.arch) {
            for groups in [1, 2] {
                let blocks = FlashBlocks {
                    head_dim,
                    groups,
                    warpgroups,
                };
                fits &= blocks.shared() <= allow_dynamic_shared(device, kernels.get(&blocks.kernel())?)?;
            }
        }
        if fits {
            dims.push(head_dim);
        }
    }
    Ok(dims)
}

/// The shared memory a kernel declares itself.
fn kernel_shared(f: &cudarc::driver::CudaFunction) -> Result<u32> {
    Ok(
        f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(driver_error("kernel attribute"))? as u32,
    )
}

/// Lets launches of `f` ask for dynamic shared memory up to what a block may have beside the
/// kernel's own; returns that most.
fn allow_dynamic_shared(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<u32> {
    let block_most =
        device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    let most = block_most.saturating_sub(kernel_shared(f)?);
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        most as i32,
    )
    .map_err(driver_error("kernel attribute"))?;
    Ok(most)
}

/// Whether the kernel that quantizes an integer matrix-vector kernel's activations lets that
/// kernel's blocks start early, to read their first weights meanwhile (`start_dependents` in
/// common.cuh; the types whose kernels read before their wait, `ReadsBeforeWait` in matmul.cu).
/// The other types' kernels read nothing before their wait, so they would have nothing to overlap.
fn starts_next_early(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4K)
}

/// `n_tokens` split into groups the matrix-vector kernels take (8, 4, 2 or 1 tokens):
/// `(first token, count)`.
fn token_groups(n_tokens: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut done = 0;
    std::iter::from_fn(move || {
        let t = [8, 4, 2, 1].into_iter().find(|&t| t <= n_tokens - done)?;
        let group = (done, t);
        done += t;
        Some(group)
    })
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: created in `new`, used by no one after this.
        let _ = unsafe { cublas::destroy_handle(self.blas) };
    }
}

/// The type cuBLAS reads a weight of type `ty` and its activations in: float weights as they are
/// stored, quantized ones dequantized to f16.
fn gemm_input(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => ty,
        _ => GgmlType::F16,
    }
}

/// Threads for a block of the RMS norms, which hold their row in registers (`held_rms_norm`):
/// `loads` float4 a thread in whole warps, or more where the row needs over 1024 threads (up to
/// NORM_LOADS). rms_norm_16 normalizes one of prefill's many rows, as few threads as hold it
/// (NORM_LOADS), so that many rows are in flight at once; rms_norm (f32 out) one decode row, a
/// float4 a thread; rms_norm_q8 one decode row (norm_q8_kernel).
fn norm_block(dim: usize, loads: usize) -> Result<u32> {
    check_norm_row(dim)?;
    Ok((dim / 4).div_ceil(loads).next_multiple_of(32).clamp(32, 1024) as u32)
}

/// The kernel that normalizes and quantizes a decode row of `dim` values, and its threads:
/// rms_norm_q8_1, a float4 a thread in 24 registers, for rows up to 4096 values; longer rows at
/// two float4 a thread (`NORM_Q8_LOADS`).
fn norm_q8_kernel(dim: usize) -> Result<(&'static str, u32)> {
    Ok(if dim <= 4 * 1024 {
        ("rms_norm_q8_1", norm_block(dim, 1)?)
    } else {
        ("rms_norm_q8", norm_block(dim, NORM_Q8_LOADS)?)
    })
}

/// Float4 a thread of rms_norm_q8's blocks: a row of 8192 then takes 1024 threads of 56
/// registers. (Rows of up to 4096 take rms_norm_q8_1 instead, whose block fits beside the
/// product before it.)
const NORM_Q8_LOADS: usize = 2;

/// The rows the RMS norms hold (`held_rms_norm` in rms_norm.cu): float4 loads, at most
/// `NORM_LOADS` of them for each of a block's 1024 threads.
fn check_norm_row(dim: usize) -> Result<()> {
    const MAX_DIM: usize = 4 * NORM_LOADS * 1024;
    if !dim.is_multiple_of(4) || dim > MAX_DIM {
        return Err(Error::Backend(format!(
            "rows of {dim} values: the CUDA RMS norm takes multiples of 4 up to {MAX_DIM}"
        )));
    }
    Ok(())
}

/// The rotated dimensions and whether pairs are halves apart, as the RoPE kernels take them.
fn rope_args(rope: Rope) -> Result<(i32, i32)> {
    if rope.dims > 2 * ROPE_MAX_PAIRS {
        return Err(Error::Backend(format!(
            "RoPE over {} dimensions: the CUDA kernels take up to {}",
            rope.dims,
            2 * ROPE_MAX_PAIRS
        )));
    }
    Ok((rope.dims as i32, i32::from(rope.layout == RopeLayout::Halves)))
}

/// The page size as the kernels take it: a power of two, so that page_row (common.cuh) finds a
/// position's page by a shift rather than a division.
fn page_size_arg(pages: &PagedKv) -> Result<i32> {
    match i32::try_from(pages.page_size) {
        Ok(size) if size > 0 && (size as u32).is_power_of_two() => Ok(size),
        _ => Err(Error::Backend(format!(
            "KV pages of {} positions: the CUDA kernels take powers of two",
            pages.page_size
        ))),
    }
}

fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 65535 * 16) as u32
}

/// A kernel argument, passed by address as cuLaunchKernelEx takes them: device pointers as u64,
/// sizes as i32 or u64, scalars as f32, and the `Matrices` struct.
trait KernelArg {
    fn param(&self) -> *mut c_void;
}

macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
kernel_arg!(u64, i32, u32, f32, Matrices);

/// Up to `MAX_MATRICES` weights of one type for one matrix-vector launch: their fields, outputs
/// and rows, as `struct Matrices` in kernels/matmul.cu lays them out.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Matrices {
    q: [u64; MAX_MATRICES],
    s: [u64; MAX_MATRICES],
    m: [u64; MAX_MATRICES],
    out: [u64; MAX_MATRICES],
    n_out: [i32; MAX_MATRICES],
    count: i32,
    accumulate: i32,
    copy_whole: i32,
}

/// Activations quantized for the integer matrix-vector kernels: int8 values, f32 block scales,
/// and whether the values are interleaved (`interleaves_activations`). `by_quiet_kernel`: written
/// by a kernel that reads little memory after its wait (one-token attention, whose cache reads
/// come before it), so the product may copy more of its rows before its own wait (`copy_whole`
/// in matmul.cu).
#[derive(Clone, Copy)]
struct Quantized {
    xq: BlockHandle,
    xd: BlockHandle,
    interleaved: bool,
    by_quiet_kernel: bool,
}

/// The activations of a matrix-vector launch: quantized to int8, f32 rows, or one f32 row that
/// the kernel RMS-normalizes itself.
#[derive(Clone, Copy)]
enum GemvInput {
    Int8(Quantized),
    F32(BlockHandle),
    Normed {
        x: BlockHandle,
        weight: BlockHandle,
        eps: f32,
    },
}

/// What a matrix-vector launch does with its products: stores them, adds them to its output, or
/// (gate and up) stores silu(gate) * up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Epilogue {
    Store,
    Add,
    SwiGlu,
}

/// The flash-attention tiles of a step: the step's position and sequence blocks, its tokens, and
/// how many tiles they make.
#[derive(Clone, Copy)]
struct FlashPlan {
    positions: BlockHandle,
    token_seqs: BlockHandle,
    n_tokens: usize,
    tile: usize,
    n_tiles: u32,
}

/// What a cuBLAS GEMM does with its product: stores it in f32, adds it to f32 rows (the residual
/// stream), or stores it in its inputs' 16-bit type.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmOutput {
    Store,
    Add,
    Store16,
}

/// Weights one matrix-vector launch takes at most (MAX_MATRICES in kernels/matmul.cu).
const MAX_MATRICES: usize = 3;

/// Host memory a queued argmax writes its index to (mapped: the kernel writes it directly, which
/// saves a copy after it), and the event marked after it.
pub struct ChoiceSlot {
    host: Pinned<u32>,
    device: u64,
    done: CudaEvent,
}

impl Drop for ChoiceSlot {
    /// The kernel may still be on its way to writing the memory about to be freed.
    fn drop(&mut self) {
        let _ = self.done.synchronize();
    }
}

impl Backend for CudaBackend {
    type Weight = CudaWeight;
    type HostF32 = PinnedF32;
    type ChoiceSlot = ChoiceSlot;

    fn device_name(&self) -> String {
        format!("CUDA {} ({})", self.device.name, self.device.arch)
    }

    fn kv_type(&self) -> KvType {
        self.kv_type
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.memory.is_some() {
            return Err(Error::Backend("the arena is already reserved".into()));
        }
        let free = self.device.free_memory()?;
        if bytes > free {
            return Err(Error::OutOfMemory(format!(
                "the model needs {bytes} bytes of GPU memory, {free} are free"
            )));
        }
        let arena_end = bytes.next_multiple_of(ALIGN);
        let argmax_state = ARGMAX_ROWS * 12;
        let partials = self.device.multiprocessors as usize * (ATTENTION_MAX_HEAD_DIM + 2) * 8;
        // SAFETY: plain allocation on our stream.
        let memory = unsafe { self.stream.alloc::<u8>(arena_end + argmax_state + partials) }
            .map_err(driver_error("allocation"))?;
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&memory, &self.stream);
        self.base = ptr;
        drop(_sync);
        self.memory = Some(memory);
        self.argmax_state = ptr + arena_end as u64;
        self.attention_partials = self.argmax_state + argmax_state as u64;
        // SAFETY: within the allocation just made, on its stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.argmax_state,
                0,
                argmax_state + partials,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("memset"))?;
        self.arena = Arena::new(bytes);
        Ok(())
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
        let (n_in, n_out) = t.matrix_shape()?;
        Self::type_suffix(t.ty).map_err(|_| Error::UnsupportedTensorType {
            name: t.name.to_string(),
            ty: t.ty.to_string(),
            op: "the CUDA backend",
        })?;
        if !n_in.is_multiple_of(32) {
            return Err(Error::Model(format!(
                "tensor {}: rows of {n_in} are not a multiple of 32",
                t.name
            )));
        }
        let split = split_weight(t.ty, t.bytes, n_in);
        let mut upload = |data: &[u8]| -> Result<Option<BlockHandle>> {
            if data.is_empty() {
                return Ok(None);
            }
            let block = self.alloc(data.len())?;
            let dst = self.base + block.offset as u64;
            // SAFETY: the block holds `data.len()` bytes; the copy from pageable host memory
            // completes before the call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
                .map_err(driver_error("weight upload"))?;
            Ok(Some(block))
        };
        let q = upload(&split.q)?.ok_or_else(|| Error::Model(format!("tensor {} is empty", t.name)))?;
        let (s, m) = (upload(&split.s)?, upload(&split.m)?);
        self.largest_weight = self.largest_weight.max(n_in * n_out);
        self.capture_max_tokens = self.capture_max_tokens.min(gemv_max_tokens(t.ty));
        Ok(CudaWeight {
            ty: t.ty,
            n_out,
            n_in,
            q,
            s,
            m,
        })
    }

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()> {
        assert!(std::mem::size_of_val(src) <= dst.len);
        // SAFETY: bounds checked above; the copy completes before the call returns (pageable memory).
        unsafe { cudarc::driver::result::memcpy_htod_async(self.ptr(dst), src, self.stream.cu_stream()) }
            .map_err(driver_error("copy to device"))
    }

    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()> {
        assert!(std::mem::size_of_val(src) <= dst.len);
        self.flash_plan.set(None);
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

    fn begin_capture(&self, n_tokens: usize) -> Result<bool> {
        // Steps whose matmuls go through cuBLAS are not recorded.
        if n_tokens > self.capture_max_tokens {
            return Ok(false);
        }
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_error("graph capture"))?;
        Ok(true)
    }

    fn end_capture(&self) -> Result<usize> {
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver_error("graph capture"))?
            .ok_or_else(|| Error::Backend("graph capture recorded nothing".into()))?;
        let mut graphs = self.graphs.borrow_mut();
        graphs.push(graph);
        Ok(graphs.len() - 1)
    }

    fn replay(&self, graph: usize) -> Result<()> {
        let graphs = self.graphs.borrow();
        let g = graphs
            .get(graph)
            .ok_or_else(|| Error::Backend(format!("no graph {graph}")))?;
        g.launch().map_err(driver_error("graph launch"))
    }

    fn embed(&self, table: &CudaWeight, ids: BlockHandle, out: BlockHandle, n_tokens: usize) -> Result<()> {
        let name = format!("embed_{}", Self::type_suffix(table.ty)?);
        let (q, s, m) = self.weight_ptrs(table);
        let dim = table.n_in as i32;
        self.launch(
            &name,
            (n_tokens as u32, 1, 1),
            128,
            &[&q, &s, &m, &dim, &self.ptr(ids), &self.ptr(out)],
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
        let block = norm_block(dim, 1)?;
        let dim = dim as i32;
        self.launch(
            "rms_norm",
            (n_tokens as u32, 1, 1),
            block,
            &[&self.ptr(x), &self.ptr(weight), &self.ptr(out), &dim, &eps],
        )
    }

    fn matmul(&self, x: BlockHandle, w: &CudaWeight, out: BlockHandle, n_tokens: usize) -> Result<()> {
        self.matmul_many(x.into(), &[w], &[out], n_tokens)
    }

    fn matmul_many(&self, x: Input, ws: &[&CudaWeight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        let gemm = |w: &CudaWeight| n_tokens > gemv_max_tokens(w.ty);
        // One quantization (or 16-bit conversion, for cuBLAS) of the activations serves every
        // weight that takes it, and weights of one type go to the matrix-vector kernels together,
        // in one launch.
        let (mut quantized, mut staged) = (None, None);
        // The norm goes into the matrix-vector kernels where they take it (`gemv_normalizes`), or,
        // where only cuBLAS reads the rows and in one 16-bit type, into their conversion. Every
        // other path reads normalized f32 rows, written once here.
        let input = gemm_input(ws[0].ty);
        let only_16bit_gemms = input != GgmlType::F32 && ws.iter().all(|w| gemm(w) && gemm_input(w.ty) == input);
        let rows = match x {
            Input::RmsNormed { .. } if only_16bit_gemms => {
                Some(self.stage_16bit(x, n_tokens, ws[0].n_in, input, &mut staged)?)
            }
            _ if ws.iter().any(|w| gemm(w) || !self.gemv_normalizes(w, n_tokens)) => {
                Some(self.input_rows(x, n_tokens, ws[0].n_in)?)
            }
            _ => None,
        };
        let x = rows.map_or(x, Input::Rows);
        let mut i = 0;
        while i < ws.len() {
            let w = ws[i];
            if let Some(rows) = rows.filter(|_| gemm(w)) {
                self.gemm(rows, w, outs[i], n_tokens, GemmOutput::Store, &mut staged)?;
                i += 1;
                continue;
            }
            let together = ws[i..]
                .iter()
                .take(MAX_MATRICES)
                .take_while(|v| v.ty == w.ty && v.n_in == w.n_in)
                .count();
            let (group, group_outs) = (&ws[i..i + together], &outs[i..i + together]);
            self.gemv(x, group, group_outs, n_tokens, Epilogue::Store, &mut quantized)?;
            i += together;
        }
        Ok(())
    }

    fn matmul_add(
        &self,
        x: BlockHandle,
        w: &CudaWeight,
        out: BlockHandle,
        _scratch: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        if n_tokens > gemv_max_tokens(w.ty) {
            return self.gemm(x, w, out, n_tokens, GemmOutput::Add, &mut None);
        }
        self.gemv(x.into(), &[w], &[out], n_tokens, Epilogue::Add, &mut None)
    }

    fn gate_up_swiglu(
        &self,
        x: Input,
        w_gate: &CudaWeight,
        w_up: &CudaWeight,
        scratch: [BlockHandle; 2],
        out: BlockHandle,
        n_tokens: usize,
        ffn_dim: usize,
    ) -> Result<()> {
        let same_shape = (w_gate.ty, w_gate.n_in, w_gate.n_out) == (w_up.ty, w_up.n_in, w_up.n_out);
        if !same_shape || n_tokens > gemv_max_tokens(w_gate.ty) {
            return gate_up_swiglu_in_steps(self, x, [w_gate, w_up], scratch, out, n_tokens, ffn_dim);
        }
        self.gemv(x, &[w_gate, w_up], &[out], n_tokens, Epilogue::SwiGlu, &mut None)
    }

    /// Where all three matrices go to cuBLAS in one 16-bit type, the gate and up products are
    /// written in that type, and SwiGLU reads them and writes the down projection's staged input:
    /// a prefill step's widest rows never pass through f32 (8B bf16, 2048 tokens: 470 MB a layer
    /// less to move). Otherwise in steps.
    fn feed_forward(
        &self,
        x: Input,
        ffn: FeedForward<'_, CudaWeight>,
        scratch: FeedForwardScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let input = gemm_input(ffn.gate.ty);
        let by_cublas = |w: &CudaWeight| n_tokens > gemv_max_tokens(w.ty) && gemm_input(w.ty) == input;
        let same_shape = (ffn.gate.n_in, ffn.gate.n_out) == (ffn.up.n_in, ffn.up.n_out);
        if input == GgmlType::F32 || !same_shape || ![ffn.gate, ffn.up, ffn.down].into_iter().all(by_cublas) {
            return feed_forward_in_steps(self, x, ffn, scratch, residual, n_tokens);
        }
        let mut staged = None;
        let rows = self.stage_16bit(x, n_tokens, ffn.gate.n_in, input, &mut staged)?;
        self.gemm(rows, ffn.gate, scratch.gate, n_tokens, GemmOutput::Store16, &mut staged)?;
        self.gemm(rows, ffn.up, scratch.up, n_tokens, GemmOutput::Store16, &mut staged)?;
        let (_, x_stage) = self.cublas_staging()?;
        let n = n_tokens * ffn.gate.n_out;
        if n * 2 > x_stage.len {
            return Err(Error::Backend(format!(
                "{n} hidden values exceed the cuBLAS staging of {} bytes",
                x_stage.len
            )));
        }
        let (n64, kind) = (n as u64, input.id() as i32);
        self.launch(
            "swiglu_16",
            (blocks_for(n.div_ceil(8), 256).min(4096), 1, 1),
            256,
            &[
                &self.ptr(scratch.gate),
                &self.ptr(scratch.up),
                &self.ptr(x_stage),
                &n64,
                &kind,
            ],
        )?;
        // The down projection reads the staged rows; `scratch.hidden` stands in for their f32 form.
        let mut staged = Some(input);
        self.gemm(
            scratch.hidden,
            ffn.down,
            residual,
            n_tokens,
            GemmOutput::Add,
            &mut staged,
        )
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
        let (nh, hd, dims) = (n_heads as i32, head_dim as i32, rope.dims as i32);
        let halves = i32::from(rope.layout == RopeLayout::Halves);
        self.launch(
            "rope",
            (n_tokens as u32, n_heads as u32, 1),
            64,
            &[
                &self.ptr(x),
                &self.ptr(positions),
                &self.ptr(freqs),
                &nh,
                &hd,
                &dims,
                &halves,
            ],
        )
    }

    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()> {
        let (n, w) = ((n_tokens * width) as u64, width as u64);
        self.launch(
            "add_bias",
            (blocks_for(n as usize, 256).min(4096), 1, 1),
            256,
            &[&self.ptr(x), &self.ptr(bias), &n, &w],
        )
    }

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
    ) -> Result<()> {
        let width = kv_width as i32;
        let (table_width, page_size) = (pages.table_width as i32, page_size_arg(&pages)?);
        self.launch(
            &format!("kv_write_{}", self.kv_suffix()),
            (n_tokens as u32, 1, 1),
            256,
            &[
                &self.ptr(k),
                &self.ptr(v),
                &self.ptr(k_cache),
                &self.ptr(v_cache),
                &self.ptr(positions),
                &self.ptr(pages.block_tables),
                &table_width,
                &self.ptr(pages.token_seqs),
                &page_size,
                &width,
            ],
        )
    }

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
        let new = NewRows { q, k, v, freqs, rope };
        let kv = AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
        };
        self.rotate_and_store(new, kv, n_tokens, shape, None)
    }

    fn attention(
        &self,
        q: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        pages: PagedKv,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let kv = AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
        };
        self.attend(q, None, kv, out, None, n_tokens, shape)
    }

    fn attend_and_project(
        &self,
        q: BlockHandle,
        kv: AttentionKv,
        wo: &CudaWeight,
        buffers: [BlockHandle; 3],
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        self.attend_then_project(q, None, kv, wo, buffers, n_tokens, shape)
    }

    /// In a step of one token, the attention kernel rotates the query and the key and stores the
    /// token's cache row itself: no rope_kv_write launch, and one kernel boundary less a layer.
    /// Steps of more tokens rotate and store the keys first (their tokens read each other's rows);
    /// in flash-attention steps that rotate whole heads, flash attention rotates the queries as it
    /// loads them.
    fn rope_attend_and_project(
        &self,
        new: NewRows,
        kv: AttentionKv,
        wo: &CudaWeight,
        buffers: [BlockHandle; 3],
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        if self.takes_flash(shape, n_tokens) && new.rope.dims == shape.head_dim {
            self.rotate_and_store(new, kv, n_tokens, shape, self.flash_turns)?;
        } else if n_tokens != 1 {
            return rope_attend_and_project_in_steps(self, new, kv, wo, buffers, n_tokens, shape);
        }
        self.attend_then_project(new.q, Some(new), kv, wo, buffers, n_tokens, shape)
    }

    fn swiglu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize) -> Result<()> {
        let n64 = n as u64;
        self.launch(
            "swiglu",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &[&self.ptr(gate), &self.ptr(up), &self.ptr(out), &n64],
        )
    }

    fn argmax(&self, x: BlockHandle, out: BlockHandle, n_rows: usize, width: usize) -> Result<()> {
        for first in (0..n_rows).step_by(ARGMAX_ROWS) {
            let rows = (n_rows - first).min(ARGMAX_ROWS);
            let x = self.ptr(x) + (first * width * 4) as u64;
            self.launch_argmax(x, self.ptr(out) + first as u64 * 4, rows, width, 0, None)?;
        }
        Ok(())
    }

    fn choice_slot(&self) -> Result<ChoiceSlot> {
        let (host, device) = Pinned::mapped(&self.device.ctx, 1)?;
        let done = self.device.ctx.new_event(None).map_err(driver_error("event"))?;
        Ok(ChoiceSlot { host, device, done })
    }

    fn queue_argmax(&self, x: BlockHandle, next: NextInput, width: usize, slot: &ChoiceSlot) -> Result<()> {
        self.launch_argmax(self.ptr(x), self.ptr(next.token), 1, width, slot.device, Some(next))
    }

    fn mark_choice(&self, slot: &ChoiceSlot) -> Result<()> {
        slot.done.record(&self.stream).map_err(driver_error("event"))
    }

    fn wait_choice(&self, slot: &ChoiceSlot) -> Result<u32> {
        slot.done.synchronize().map_err(driver_error("synchronize"))?;
        Ok(slot.host[0])
    }

    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        let n64 = n as u64;
        self.launch(
            "add",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &[&self.ptr(x), &self.ptr(y), &n64],
        )
    }

    fn weight_bytes(&self, matrices: &[usize]) -> usize {
        // Up to three fields per matrix, each aligned; Q6_K's metadata grows by 2 bytes a block.
        matrices.iter().map(|b| b + b / 100 + 3 * ALIGN).sum()
    }

    fn prepare(&mut self, max_tokens: usize, max_n_in: usize) -> Result<()> {
        if self.staging.is_none() && max_tokens > GEMV_MAX_TOKENS {
            let w = self.alloc(self.largest_weight * 2)?;
            let x = self.alloc(max_tokens * max_n_in * 2)?;
            self.staging = Some((w, x));
        }
        if self.int8_activations.is_none() {
            let values = GEMV_MAX_TOKENS.min(max_tokens) * max_n_in;
            // Scales sized for the larger layout, Q4_K's (with the sums).
            let scales = q8_scale_bytes(GgmlType::Q4K, values);
            self.int8_activations = Some((self.alloc(values)?, self.alloc(scales)?));
        }
        if self.flash_tiles.is_none() && max_tokens >= FLASH_MIN_TOKENS {
            self.flash_tiles = Some(self.alloc(max_tokens * 8)?);
            self.flash_turns = Some(self.alloc(max_tokens * FLASH_MAX_PAIRS * 8)?);
        }
        Ok(())
    }

    fn staging_bytes(&self, largest_weight: usize, max_tokens: usize, max_n_in: usize) -> usize {
        let cublas = if max_tokens > GEMV_MAX_TOKENS {
            largest_weight * 2 + max_tokens * max_n_in * 2 + 2 * ALIGN
        } else {
            0
        };
        let flash = if max_tokens >= FLASH_MIN_TOKENS {
            max_tokens * 8 + max_tokens * FLASH_MAX_PAIRS * 8 + 2 * ALIGN
        } else {
            0
        };
        let int8 = GEMV_MAX_TOKENS.min(max_tokens) * max_n_in * 2 + 2 * ALIGN;
        cublas + flash + int8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_tiles_are_runs_of_one_sequence_at_consecutive_positions() {
        // A 140-token prompt chunk of sequence 0 from position 5, a decode of sequence 1, then
        // sequence 2 restarting at 0 right after sequence 0's positions would continue.
        let mut positions: Vec<u32> = (5..145).collect();
        let mut seqs = vec![0u32; 140];
        positions.extend([40, 0, 1]);
        seqs.extend([1, 2, 2]);
        assert_eq!(
            query_tiles(&positions, &seqs, 128),
            vec![0, 128, 128, 12, 140, 1, 141, 2]
        );
        assert_eq!(query_tiles(&positions, &seqs, 64)[..6], [0, 64, 64, 64, 128, 12]);
        assert!(query_tiles(&[], &[], 64).is_empty());
    }

    #[test]
    fn interleaved_rows_are_tiles_stored_piece_by_piece() {
        // Twelve 32-byte units, byte j of unit u = 32 u + j: a tile of eight, then one of four.
        let row: Vec<u8> = (0..12 * 32).map(|i| i as u8).collect();
        let mut out = Vec::new();
        interleave_row(&row, 32, &mut out);
        let pieces: Vec<u8> = out.chunks_exact(16).map(|p| p[0]).collect();
        let piece = |unit: u8, k: u8| 32 * unit + 16 * k;
        let mut expected: Vec<u8> = Vec::new();
        expected.extend((0..8).map(|u| piece(u, 0)));
        expected.extend((0..8).map(|u| piece(u, 1)));
        expected.extend((8..12).map(|u| piece(u, 0)));
        expected.extend((8..12).map(|u| piece(u, 1)));
        assert_eq!(pieces, expected);
        assert!(out.chunks_exact(16).all(|p| p.windows(2).all(|w| w[1] == w[0] + 1)));
    }

    #[test]
    fn flash_blocks_fit_two_a_hopper_multiprocessor() {
        // The 8B's heads (32 of 128) on the H200's 132 multiprocessors: 2048 tokens make two
        // blocks a multiprocessor of 128 queries, 512 tokens take blocks of 64.
        let shape = AttentionShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
        };
        for warpgroups in [false, true] {
            let long = FlashBlocks::for_step(shape, 2048, 132, warpgroups);
            let short = FlashBlocks::for_step(shape, 512, 132, warpgroups);
            assert_eq!((long.tile(), short.tile()), (128, 64));
            assert_eq!(long.warpgroups, warpgroups);
            // Every kernel's launch bounds ask for at least two blocks a multiprocessor: 233,472
            // bytes of shared memory, 1024 of each block reserved.
            for blocks in [long, short] {
                assert!(2 * (blocks.shared() + 1024) <= 233_472, "{}", blocks.kernel());
            }
        }
        let wide = FlashBlocks::for_step(shape, 2048, 132, true);
        assert_eq!(
            (wide.threads(), wide.kernel().as_str()),
            (256, "flash_attention_wg_128_2")
        );
        // Tiles of 128 queries, 4 buffers of 64 keys, 1024 bytes to align.
        assert_eq!(wide.shared(), (4 * 64 + 128) * 128 * 2 + 1024);
    }

    #[test]
    fn even_spreads_hold_a_share_of_blocks_a_multiprocessor() {
        // The H200's shared memory, and Q4_K's one-token product kernel (three blocks a
        // multiprocessor by registers).
        let products = EvenSpread {
            multiprocessors: 132,
            blocks_per_multiprocessor: 3,
            kernel_shared: 36_864,
            multiprocessor_shared: 233_472,
            reserved_shared: 1024,
        };
        let holds = |blocks| {
            let block = products.padding(blocks) + products.kernel_shared + products.reserved_shared;
            (products.multiprocessor_shared / block).min(products.blocks_per_multiprocessor)
        };
        assert_eq!(holds(256), 2);
        assert_eq!(holds(132), 1);
        assert_eq!(holds(40), 1);
        assert_eq!(products.padding(384), 0);
        assert_eq!(products.padding(1792), 0);
    }

    #[test]
    fn norm_blocks_hold_rows_of_multiples_of_four_up_to_16384() {
        assert_eq!(norm_block(48, 1).unwrap(), 32);
        assert_eq!(norm_block(576, 1).unwrap(), 160);
        assert_eq!(norm_block(4096, 1).unwrap(), 1024);
        assert_eq!(norm_block(16384, 1).unwrap(), 1024);
        assert_eq!(norm_block(4096, NORM_Q8_LOADS).unwrap(), 512);
        // The one-float4 kernel up to rows of 4096; longer rows at two a thread.
        assert_eq!(norm_q8_kernel(576).unwrap(), ("rms_norm_q8_1", 160));
        assert_eq!(norm_q8_kernel(4096).unwrap(), ("rms_norm_q8_1", 1024));
        assert_eq!(norm_q8_kernel(4352).unwrap(), ("rms_norm_q8", 544));
        assert_eq!(norm_q8_kernel(8192).unwrap(), ("rms_norm_q8", 1024));
        assert_eq!(norm_block(48, NORM_LOADS).unwrap(), 32);
        assert_eq!(norm_block(576, NORM_LOADS).unwrap(), 64);
        assert_eq!(norm_block(4096, NORM_LOADS).unwrap(), 256);
        assert_eq!(norm_block(16384, NORM_LOADS).unwrap(), 1024);
        for dim in [4098, 16388] {
            for loads in [1, NORM_LOADS] {
                let err = norm_block(dim, loads).unwrap_err().to_string();
                assert!(err.contains(&dim.to_string()), "{err}");
            }
        }
    }
}
