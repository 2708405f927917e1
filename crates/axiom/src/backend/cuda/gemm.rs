//! Products through cuBLAS, for steps of more tokens than the matrix-vector kernels take:
//! quantized weights dequantized to f16 first, activations staged in 16 bits; FP8 weights on
//! Hopper's FP8 tensor cores where cuBLASLt takes them (fp8_gemm.rs).

use super::launch::blocks_for;
use super::matmul::MatmulPlan;
use super::params::{ConvertF32Params, DequantParams, Glu16Params};
use super::weights::CudaWeight;
use super::CudaBackend;
use crate::backend::{feed_forward_in_steps, Activation, BlockHandle, FeedForward, FeedForwardScratch, Input};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use cudarc::cublas::{result as cublas, sys as cublas_sys};

/// What a cuBLAS GEMM does with its product: stores it in f32, adds it to f32 rows (the residual
/// stream), or stores it in its inputs' 16-bit type.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum GemmOutput {
    Store,
    Add,
    Store16,
}

/// What the cuBLAS staging holds of a step's input, so that the weights sharing it convert it once.
#[derive(Clone, Copy, Default)]
pub(super) struct Staged {
    /// The input in this 16-bit type, in the activations' staging.
    pub(super) sixteen: Option<GgmlType>,
    /// The input quantized for the FP8 tensor cores, in the weights' staging (`gemm_fp8`).
    pub(super) fp8: bool,
}

impl Staged {
    /// The activations' staging holds the input in `ty`.
    pub(super) fn sixteen(ty: GgmlType) -> Staged {
        Staged {
            sixteen: Some(ty),
            fp8: false,
        }
    }
}

/// The type cuBLAS reads a weight of type `ty` and its activations in: float weights as they are
/// stored, quantized ones dequantized to f16.
pub(super) fn gemm_input(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => ty,
        _ => GgmlType::F16,
    }
}

impl CudaBackend {
    /// `out = x w^T` through cuBLAS, stored or added as `output` says. Its 16-bit input is
    /// staged: `staged` says which type the staging already holds `x` in, so the weights that
    /// share an input convert it once. FP8 weights run on the FP8 tensor cores where
    /// `fp8_product` finds they can.
    pub(super) fn gemm(
        &self,
        x: BlockHandle,
        w: &CudaWeight,
        out: BlockHandle,
        n_tokens: usize,
        output: GemmOutput,
        staged: &mut Staged,
    ) -> Result<()> {
        if let Some(product) = self.fp8_product(w, n_tokens, out, output)? {
            return self.gemm_fp8(x, w, out, n_tokens, output, staged, product);
        }
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
            self.launch(
                &name,
                (blocks_for(chunks, 256), 1, 1),
                256,
                &DequantParams {
                    q,
                    s,
                    m,
                    n_in: n_in as i32,
                    out: self.ptr(w_stage),
                    n_out: n_out as i32,
                },
            )?;
            // The weights' staging no longer holds FP8 activations.
            staged.fp8 = false;
            self.ptr(w_stage)
        };
        let b = if input == GgmlType::F32 {
            self.ptr(x)
        } else {
            if staged.sixteen != Some(input) {
                let (n, kind) = ((n_tokens * n_in) as u64, input.id() as i32);
                self.launch(
                    "convert_f32",
                    (blocks_for(n.div_ceil(4) as usize, 256), 1, 1),
                    256,
                    &ConvertF32Params {
                        x: self.ptr(x),
                        out: self.ptr(x_stage),
                        n,
                        kind,
                    },
                )?;
                staged.sixteen = Some(input);
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

    /// The 16-bit staging cuBLAS reads from: (a dequantized weight, the converted activations).
    pub(super) fn cublas_staging(&self) -> Result<(BlockHandle, BlockHandle)> {
        self.staging
            .ok_or_else(|| Error::Backend("no cuBLAS staging reserved".into()))
    }

    /// The rows `gemm` takes for `x`. An `Input::RmsNormed` is normalized straight into the 16-bit
    /// staging as `ty`, and `staged` then says so: the handle returned is its scratch, standing in
    /// for f32 rows that `gemm` finds staged and does not read. Where `first`, the first weight
    /// to read them, may take the FP8 tensor cores, they are also quantized for it.
    pub(super) fn stage_16bit(
        &self,
        x: Input,
        n_tokens: usize,
        first: &CudaWeight,
        ty: GgmlType,
        staged: &mut Staged,
    ) -> Result<BlockHandle> {
        match x {
            Input::Rows(rows) => Ok(rows),
            Input::RmsNormed {
                x,
                weight,
                eps,
                scratch,
            } => {
                let fp8 = self.fp8_activations(first, n_tokens);
                self.rms_norm_16bit(x, weight, eps, n_tokens, first.n_in, ty, fp8)?;
                *staged = Staged {
                    sixteen: Some(ty),
                    fp8: fp8.is_some(),
                };
                Ok(scratch)
            }
        }
    }

    /// Where all three matrices go to cuBLAS in one 16-bit type, the gate and up products are
    /// written in that type, and the gated activation reads them and writes the down projection's staged input:
    /// a prefill step's widest rows never pass through f32 (8B bf16, 2048 tokens: 470 MB a layer
    /// less to move). Otherwise in steps.
    pub(super) fn feed_forward_16bit(
        &self,
        x: Input,
        ffn: FeedForward<'_, CudaWeight>,
        scratch: FeedForwardScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let input = gemm_input(ffn.gate.ty);
        let by_cublas = |w: &CudaWeight| self.matmul_plan(w, n_tokens) == MatmulPlan::Gemm && gemm_input(w.ty) == input;
        let same_shape = (ffn.gate.n_in, ffn.gate.n_out) == (ffn.up.n_in, ffn.up.n_out);
        if input == GgmlType::F32 || !same_shape || ![ffn.gate, ffn.up, ffn.down].into_iter().all(by_cublas) {
            return feed_forward_in_steps(self, x, ffn, scratch, residual, n_tokens);
        }
        let mut staged = Staged::default();
        let rows = self.stage_16bit(x, n_tokens, ffn.gate, input, &mut staged)?;
        self.gemm(rows, ffn.gate, scratch.gate, n_tokens, GemmOutput::Store16, &mut staged)?;
        self.gemm(rows, ffn.up, scratch.up, n_tokens, GemmOutput::Store16, &mut staged)?;
        // The down projection reads the staged rows; `scratch.hidden` stands in for their f32 form.
        // Its FP8 plan, if any, is made once: the gated activation writes what it reads.
        let product = self.fp8_product(ffn.down, n_tokens, residual, GemmOutput::Add)?;
        let (hidden, down, add) = (scratch.hidden, ffn.down, GemmOutput::Add);
        match product {
            Some(product) => {
                let (glu, act) = ([scratch.gate, scratch.up], ffn.activation);
                self.quantize_fp8_glu(glu, input, act, &product, n_tokens, down.n_in)?;
                let mut staged = Staged {
                    sixteen: None,
                    fp8: true,
                };
                self.gemm_fp8(hidden, down, residual, n_tokens, add, &mut staged, product)
            }
            None => {
                let glu = [scratch.gate, scratch.up];
                self.glu_16bit(glu, input, ffn.activation, n_tokens * ffn.gate.n_out)?;
                self.gemm(hidden, down, residual, n_tokens, add, &mut Staged::sixteen(input))
            }
        }
    }

    /// `act(gate) * up` of the 16-bit (`kind`) gate and up products, `n` values, into the 16-bit
    /// staging as the down projection's cuBLAS GEMM reads them.
    fn glu_16bit(&self, [gate, up]: [BlockHandle; 2], kind: GgmlType, act: Activation, n: usize) -> Result<()> {
        let (_, x_stage) = self.cublas_staging()?;
        if n * 2 > x_stage.len {
            return Err(Error::Backend(format!(
                "{n} hidden values exceed the cuBLAS staging of {} bytes",
                x_stage.len
            )));
        }
        self.launch(
            "glu_16",
            (blocks_for(n.div_ceil(8), 256).min(4096), 1, 1),
            256,
            &Glu16Params {
                gate: self.ptr(gate),
                up: self.ptr(up),
                out: self.ptr(x_stage),
                n: n as u64,
                kind: kind.id() as i32,
                act: act.code() as i32,
            },
        )
    }
}
