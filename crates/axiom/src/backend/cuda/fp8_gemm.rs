//! Prompt products of FP8 weights on Hopper's FP8 tensor cores, through cuBLASLt: the weight's
//! E4M3 codes as they are uploaded, its scales in one of cuBLASLt's block layouts
//! (`CudaWeight::lt_scales`), and the activations quantized on the fly to E4M3 with a scale per
//! token per 128 values (`quantize_fp8` in kernels/fp8_gemm.cu), the dynamic scheme of FP8
//! checkpoints. Elsewhere, and for what these layouts do not hold, FP8 weights are dequantized to
//! f16 for cuBLAS (`gemm`).
//!
//! Only Hopper's cuBLASLt (12.9 on) takes 128-value and 128 x 128 block scales, and only with
//! these operands transposed as here (A the weight, K-major; B the activations); both scale
//! tables 16-byte aligned, M and N multiples of 4 (a step is padded to a multiple of 4 tokens),
//! and no fast accumulation, which these scales refuse. cuBLASLt chooses its kernel by the
//! step's size, so `--deterministic` never takes this path (`Paths::fp8_tensor_cores`).

use super::gemm::{GemmOutput, Staged};
use super::launch::blocks_for;
use super::memory::ALIGN;
use super::params::QuantizeFp8Params;
use super::weights::{CudaWeight, LtScales};
use super::{kernels, CudaBackend};
use crate::backend::{Activation, BlockHandle};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use cudarc::cublaslt::{result as lt, sys as lt_sys};
use std::cell::RefCell;
use std::collections::HashMap;

/// The environment variable that picks how prompts multiply FP8 weights: `lt` (FP8 tensor cores
/// where the device and the weight's scales allow, the default) or `dequant` (f16 for cuBLAS).
pub const FP8_GEMM_VAR: &str = "AXIOM_CUDA_FP8_GEMM";

/// Workspace offered to cuBLASLt: what NVIDIA advises for Hopper, where its split-K kernels use it.
pub(super) const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// The first cuBLASLt with 128-value and 128 x 128 block scales.
const LT_MIN_VERSION: usize = 120900;

/// Bytes of the staging that a step of up to `max_tokens` rows of up to `max_n_in` takes quantized
/// for the FP8 tensor cores (`fp8_product`): the codes, then the scales.
pub(super) fn fp8_activation_bytes(max_tokens: usize, max_n_in: usize) -> usize {
    let values = max_tokens.next_multiple_of(4) * max_n_in;
    values.next_multiple_of(ALIGN) + values / 32
}

/// A product's shape and kind, by which cuBLASLt's choice of kernel is cached.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct LtShape {
    n_out: usize,
    n_in: usize,
    /// Tokens, padded to a multiple of 4.
    cols: usize,
    scales: LtScales,
    output: GemmOutput,
}

/// The cuBLASLt handle, its workspace, and the kernel it chose for each shape (none where it has
/// none: those products are dequantized instead).
pub(super) struct Fp8Lt {
    handle: lt_sys::cublasLtHandle_t,
    pub(super) workspace: Option<BlockHandle>,
    algos: RefCell<HashMap<LtShape, Option<lt_sys::cublasLtMatmulAlgo_t>>>,
}

impl Fp8Lt {
    /// cuBLASLt's FP8 GEMM for a device of `arch`, where it has the block scales and
    /// `AXIOM_CUDA_FP8_GEMM` does not ask for the f16 path; none otherwise.
    pub(super) fn new(arch: &str) -> Result<Option<Fp8Lt>> {
        let wanted = match std::env::var(FP8_GEMM_VAR) {
            Err(_) => true,
            Ok(v) if v == "lt" => true,
            Ok(v) if v == "dequant" => false,
            Ok(v) => {
                return Err(Error::Backend(format!(
                    "{FP8_GEMM_VAR}={v} is refused: it takes lt (FP8 tensor cores) or dequant (f16)"
                )))
            }
        };
        if !wanted || !kernels::has_fp8_gemm(arch) {
            return Ok(None);
        }
        // SAFETY: only probes for the shared library, then queries its version.
        let version = unsafe { lt_sys::is_culib_present().then(|| lt_sys::cublasLtGetVersion()) };
        match version {
            Some(v) if v >= LT_MIN_VERSION => {}
            found => {
                tracing::warn!(
                    "cuBLASLt {found:?} has no FP8 block scales (12.9 on has): FP8 prompts dequantize to f16"
                );
                return Ok(None);
            }
        }
        let handle = lt::create_handle().map_err(|e| Error::Backend(format!("cuBLASLt: {e:?}")))?;
        Ok(Some(Fp8Lt {
            handle,
            workspace: None,
            algos: RefCell::new(HashMap::new()),
        }))
    }
}

impl Drop for Fp8Lt {
    fn drop(&mut self) {
        // SAFETY: created in `new`, used by no one after this.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// One product's cuBLASLt descriptors, destroyed with it.
struct LtOp {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
}

impl Drop for LtOp {
    fn drop(&mut self) {
        // SAFETY: created in `LtOp::new`, and no call that uses them is still being set up.
        unsafe {
            for layout in self.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn lt_error(what: &'static str) -> impl Fn(lt::CublasError) -> Error {
    move |e| Error::Backend(format!("cuBLASLt {what}: {e:?}"))
}

impl LtOp {
    /// D (n_out x cols, column-major: the rows of `cols` tokens) = W^T X: W the weight's codes
    /// as a column-major n_in x n_out (row-major rows), X the quantized tokens as n_in x cols;
    /// the weight's scales at `w_scales`, the tokens' at `x_scales`.
    fn new(shape: LtShape, w_scales: u64, x_scales: u64) -> Result<LtOp> {
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        use lt_sys::cublasLtMatmulMatrixScale_t as S;
        use lt_sys::cudaDataType_t as T;
        let out_type = match shape.output {
            GemmOutput::Store16 => T::CUDA_R_16F,
            GemmOutput::Store | GemmOutput::Add => T::CUDA_R_32F,
        };
        let desc = lt::create_matmul_desc(lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
            .map_err(lt_error("descriptor"))?;
        let mut op = LtOp {
            desc,
            layouts: [std::ptr::null_mut(); 3],
        };
        let layout = |ty, rows: usize, cols: usize| lt::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64);
        op.layouts[0] = layout(T::CUDA_R_8F_E4M3, shape.n_in, shape.n_out).map_err(lt_error("layout"))?;
        op.layouts[1] = layout(T::CUDA_R_8F_E4M3, shape.n_in, shape.cols).map_err(lt_error("layout"))?;
        op.layouts[2] = layout(out_type, shape.n_out, shape.cols).map_err(lt_error("layout"))?;
        let w_mode = match shape.scales {
            LtScales::Blocks => S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
            LtScales::Rows => S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        };
        let (transpose, keep) = (1i32, 0i32);
        let set = |attr, value: *const std::ffi::c_void, size| {
            // SAFETY: the descriptor is live; `value` points at `size` bytes of the attribute's type.
            unsafe { lt::set_matmul_desc_attribute(op.desc, attr, value, size) }.map_err(lt_error("attribute"))
        };
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, (&transpose as *const i32).cast(), 4)?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, (&keep as *const i32).cast(), 4)?;
        set(A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, (&w_mode as *const S).cast(), 4)?;
        let x_mode = S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        set(A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, (&x_mode as *const S).cast(), 4)?;
        set(
            A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            (&w_scales as *const u64).cast(),
            8,
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            (&x_scales as *const u64).cast(),
            8,
        )?;
        Ok(op)
    }
}

/// A step's activations quantized for the FP8 tensor cores: E4M3 codes and their scales, the step
/// padded to `cols` tokens.
#[derive(Clone, Copy)]
pub(super) struct Fp8Activations {
    pub(super) codes: BlockHandle,
    pub(super) scales: BlockHandle,
    pub(super) cols: usize,
}

/// A product that runs on the FP8 tensor cores: its descriptors, cuBLASLt's kernel for them, and
/// where the quantized tokens go (in the weights' cuBLAS staging, free on this path).
pub(super) struct Fp8Product {
    op: LtOp,
    algo: lt_sys::cublasLtMatmulAlgo_t,
    cols: usize,
    codes: BlockHandle,
    scales: BlockHandle,
}

impl CudaBackend {
    /// Whether prompts may multiply FP8 weights on the FP8 tensor cores: a Hopper GPU with
    /// cuBLASLt 12.9 or later, `AXIOM_CUDA_FP8_GEMM` not `dequant`, and the default paths. Each
    /// weight then needs scales cuBLASLt takes (`CudaWeight::takes_fp8_tensor_cores`).
    pub fn fp8_tensor_cores(&self) -> bool {
        self.fp8_lt.is_some() && self.paths.fp8_tensor_cores()
    }

    /// How `w`'s product over `n_tokens` into `out` runs on the FP8 tensor cores, if it can: its
    /// scales in a layout cuBLASLt takes, rows of a multiple of 16 (cuBLASLt's FP8 kernels want
    /// 16-byte aligned rows of D in any output type), room in `out` for the step padded to a
    /// multiple of 4 tokens (the padding's rows are written with zeros, or added zeros) and in
    /// the staging for its codes, and a kernel cuBLASLt has for the shape.
    pub(super) fn fp8_product(
        &self,
        w: &CudaWeight,
        n_tokens: usize,
        out: BlockHandle,
        output: GemmOutput,
    ) -> Result<Option<Fp8Product>> {
        let (Some(lt), Some((w_scales, scales))) = (self.fp8_lt.as_ref(), w.lt_scales) else {
            return Ok(None);
        };
        let out_bytes = if output == GemmOutput::Store16 { 2 } else { 4 };
        let (Some(slots), Some(workspace)) = (self.fp8_activations(w, n_tokens), lt.workspace) else {
            return Ok(None);
        };
        let Fp8Activations {
            codes,
            scales: x_scales,
            cols,
        } = slots;
        if !w.n_out.is_multiple_of(16) || cols * w.n_out * out_bytes > out.len {
            return Ok(None);
        }
        let shape = LtShape {
            n_out: w.n_out,
            n_in: w.n_in,
            cols,
            scales,
            output,
        };
        let op = LtOp::new(shape, self.ptr(w_scales), self.ptr(x_scales))?;
        let cached = lt.algos.borrow().get(&shape).copied();
        let algo = match cached {
            Some(algo) => algo,
            None => {
                let algo = self
                    .choose_algo(lt, &op, workspace.len)
                    .inspect_err(|e| tracing::warn!("{e}, for {shape:?}: dequantizing to f16 instead"))
                    .ok();
                lt.algos.borrow_mut().insert(shape, algo);
                algo
            }
        };
        Ok(algo.map(|algo| Fp8Product {
            op,
            algo,
            cols,
            codes,
            scales: x_scales,
        }))
    }

    /// Where `n_tokens` rows of `w`'s input go quantized for the FP8 tensor cores, if `w` may
    /// take them: codes, then scales, at the start of the weights' cuBLAS staging (free on this
    /// path). The same for every weight of one row length, so products of one input share them.
    pub(super) fn fp8_activations(&self, w: &CudaWeight, n_tokens: usize) -> Option<Fp8Activations> {
        let (w_stage, _) = self.staging?;
        let cols = n_tokens.next_multiple_of(4);
        let codes_len = cols * w.n_in;
        let scales_at = codes_len.next_multiple_of(ALIGN);
        let scales_len = codes_len / 32;
        let takes = self.fp8_lt.is_some()
            && self.paths.fp8_tensor_cores()
            && w.lt_scales.is_some()
            && scales_at + scales_len <= w_stage.len;
        takes.then(|| Fp8Activations {
            codes: w_stage.slice(0, codes_len),
            scales: w_stage.slice(scales_at, scales_len),
            cols,
        })
    }

    /// cuBLASLt's first choice of kernel for `op`; an error if it has none (or refuses the
    /// descriptors), which leaves the shape to the f16 path.
    fn choose_algo(&self, lt: &Fp8Lt, op: &LtOp, workspace: usize) -> Result<lt_sys::cublasLtMatmulAlgo_t> {
        let pref = lt::create_matmul_pref().map_err(lt_error("preference"))?;
        let [a, b, d] = op.layouts;
        // SAFETY: every descriptor is live; the preference is destroyed before returning.
        let chosen = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const usize).cast(),
                std::mem::size_of::<usize>(),
            );
            let chosen = set.and_then(|()| lt::get_matmul_algo_heuristic(lt.handle, op.desc, a, b, d, d, pref));
            let _ = lt::destroy_matmul_pref(pref);
            chosen
        };
        chosen
            .map(|heuristic| heuristic.algo)
            .map_err(lt_error("has no FP8 GEMM"))
    }

    /// The hidden rows of a feed-forward block, `act(gate) * up` of its 16-bit (`kind`) gate
    /// and up products, quantized for `product` (the down projection's) as they are made.
    pub(super) fn quantize_fp8_glu(
        &self,
        [gate, up]: [BlockHandle; 2],
        kind: GgmlType,
        act: Activation,
        product: &Fp8Product,
        n_tokens: usize,
        n_in: usize,
    ) -> Result<()> {
        let params = QuantizeFp8Params {
            x: self.ptr(gate),
            up: self.ptr(up),
            codes: self.ptr(product.codes),
            scales: self.ptr(product.scales),
            n_tokens: n_tokens as i32,
            cols: product.cols as i32,
            n_in: n_in as i32,
            kind: kind.id() as i32,
            act: act.code() as i32,
        };
        self.launch_quantize_fp8("quantize_fp8_glu", &params)
    }

    /// A quantization kernel of kernels/fp8_gemm.cu: a half-warp a token's 128 values.
    fn launch_quantize_fp8(&self, kernel: &str, params: &QuantizeFp8Params) -> Result<()> {
        let warps = (params.cols as usize * (params.n_in as usize / 128)).div_ceil(2);
        self.launch(kernel, (blocks_for(warps * 32, 256).min(65535), 1, 1), 256, params)
    }

    /// `out = x w^T` (stored, added or stored in f16, as `output` says) on the FP8 tensor cores,
    /// as `product` (`fp8_product`) planned it. The tokens are quantized unless `staged` says
    /// the staging already holds them (weights that share an input, as gate and up do); they are
    /// read from the 16-bit staging where `staged` says it holds them, else from `x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_fp8(
        &self,
        x: BlockHandle,
        w: &CudaWeight,
        out: BlockHandle,
        n_tokens: usize,
        output: GemmOutput,
        staged: &mut Staged,
        product: Fp8Product,
    ) -> Result<()> {
        let lt = self
            .fp8_lt
            .as_ref()
            .ok_or_else(|| Error::Backend("an FP8 product planned without cuBLASLt".into()))?;
        let workspace = lt
            .workspace
            .ok_or_else(|| Error::Backend("no cuBLASLt workspace reserved".into()))?;
        let Fp8Product {
            op,
            algo,
            cols,
            codes,
            scales,
        } = product;
        if !staged.fp8 {
            let (source, kind) = match staged.sixteen {
                Some(ty) => (self.ptr(self.cublas_staging()?.1), ty),
                None => (self.ptr(x), GgmlType::F32),
            };
            let params = QuantizeFp8Params {
                x: source,
                up: 0,
                codes: self.ptr(codes),
                scales: self.ptr(scales),
                n_tokens: n_tokens as i32,
                cols: cols as i32,
                n_in: w.n_in as i32,
                kind: kind.id() as i32,
                act: 0,
            };
            self.launch_quantize_fp8("quantize_fp8", &params)?;
            staged.fp8 = true;
        }
        let (alpha, beta) = (1.0f32, if output == GemmOutput::Add { 1.0f32 } else { 0.0 });
        let [a, b, d] = op.layouts;
        let out_ptr = self.ptr(out) as *mut std::ffi::c_void;
        // SAFETY: the pointers are arena blocks holding these shapes (`fp8_product` checked the
        // output's and the staging's room), the algorithm was chosen for these descriptors, and
        // the call is queued on the backend's stream.
        unsafe {
            lt::matmul(
                lt.handle,
                op.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                self.ptr(w.q) as *const _,
                a,
                self.ptr(codes) as *const _,
                b,
                out_ptr,
                d,
                out_ptr,
                d,
                &algo,
                self.ptr(workspace) as *mut _,
                workspace.len,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(lt_error("FP8 GEMM"))
    }
}
