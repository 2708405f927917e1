//! Matrix products: the matrix-vector kernels of kernels/matmul.cu for steps of a few tokens (on
//! int8 activations where the weights take them), and the choice between them and cuBLAS.

use super::gemm::{gemm_input, GemmOutput, Staged};
use super::launch::blocks_for;
use super::norms::{norm_q8_kernel, norm_q8_rows_kernel};
use super::params::{GemvIntParams, GemvNormedParams, GemvParams, Matrices, QuantizeQ8Params, RmsNormQ8Params};
use super::weights::CudaWeight;
use super::{kernels, CudaBackend};
use crate::backend::{gate_up_glu_in_steps, Activation, Backend, BlockHandle, GluRows, Input};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// Tokens up to which a matmul of quantized weights uses the matrix-vector kernels rather than
/// cuBLAS (which needs the whole matrix dequantized first), unless every step takes them
/// (`Paths::gemv_max_tokens`).
pub(super) const GEMV_MAX_TOKENS: usize = 8;

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

/// Weights one matrix-vector launch takes at most (MAX_MATRICES in kernels/params.cuh).
pub(super) const MAX_MATRICES: usize = 3;

/// Rows a warp of the one-token Q4_K integer matrix-vector kernel takes (as Q4K_ROWS in
/// kernels/matmul.cu).
pub(super) const Q4K_ROWS: usize = 2;

/// Whether the integer kernels for `ty` take their activations interleaved (`q8_slot` in
/// kernels/common.cuh): Q4_K's and Q6_K's, whose lanes take 64 values each (`kquant_rows`), so one
/// quantization serves both (a Q4_K_M file's Q, K and V). Their scales then come with each
/// block's sum (`store_q8_scale`).
pub(super) fn interleaves_activations(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q6K)
}

/// Bytes of block scales for `n` activations quantized for `ty`'s integer kernels: an f32 per 32
/// values, and for interleaved ones the block's sum beside it.
pub(super) fn q8_scale_bytes(ty: GgmlType, n: usize) -> usize {
    let per_block = if interleaves_activations(ty) { 8 } else { 4 };
    n / 32 * per_block
}

/// Whether the kernel that quantizes an integer matrix-vector kernel's activations lets that
/// kernel's blocks start early, to read their first weights meanwhile (`start_dependents` in
/// common.cuh; the types whose kernels read before their wait, `ReadsBeforeWait` in matmul.cu).
/// The other types' kernels read nothing before their wait, so they would have nothing to overlap.
pub(super) fn starts_next_early(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K)
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

impl CudaBackend {
    /// `Backend::matmul_many`.
    pub(super) fn multiply(&self, x: Input, ws: &[&CudaWeight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        let plan = |w: &CudaWeight| self.matmul_plan(w, n_tokens);
        // One quantization (or 16-bit conversion, for cuBLAS) of the activations serves every
        // weight that takes it, and weights of one type go to the matrix-vector kernels together,
        // in one launch.
        let (mut quantized, mut staged) = (None, Staged::default());
        // The norm goes into the matrix-vector kernels where they take it (`normalizes_input`), or,
        // where only cuBLAS reads the rows and in one 16-bit type, into their conversion. Every
        // other path reads normalized f32 rows, written once here.
        let input = gemm_input(ws[0].ty);
        let only_16bit_gemms = input != GgmlType::F32
            && ws
                .iter()
                .all(|w| plan(w) == MatmulPlan::Gemm && gemm_input(w.ty) == input);
        let rows = match x {
            Input::RmsNormed { .. } if only_16bit_gemms => {
                Some(self.stage_16bit(x, n_tokens, ws[0], input, &mut staged)?)
            }
            _ if ws.iter().any(|w| !plan(w).normalizes_input()) => Some(self.input_rows(x, n_tokens, ws[0].n_in)?),
            _ => None,
        };
        let x = rows.map_or(x, Input::Rows);
        let mut i = 0;
        while i < ws.len() {
            let w = ws[i];
            match plan(w) {
                MatmulPlan::Gemm => {
                    // `x` is rows here: a GEMM's were written above.
                    let rows = self.input_rows(x, n_tokens, w.n_in)?;
                    self.gemm(rows, w, outs[i], n_tokens, GemmOutput::Store, &mut staged)?;
                    i += 1;
                }
                // The group goes as its first weight's plan says.
                MatmulPlan::Gemv(gemv) => {
                    let together = ws[i..]
                        .iter()
                        .take(MAX_MATRICES)
                        .take_while(|v| v.ty == w.ty && v.n_in == w.n_in)
                        .count();
                    let (group, group_outs) = (&ws[i..i + together], &outs[i..i + together]);
                    self.gemv(x, group, group_outs, n_tokens, gemv, Epilogue::Store, &mut quantized)?;
                    i += together;
                }
            }
        }
        Ok(())
    }

    /// `Backend::matmul_add`.
    pub(super) fn multiply_add(&self, x: BlockHandle, w: &CudaWeight, out: BlockHandle, n_tokens: usize) -> Result<()> {
        match self.matmul_plan(w, n_tokens) {
            MatmulPlan::Gemm => self.gemm(x, w, out, n_tokens, GemmOutput::Add, &mut Staged::default()),
            MatmulPlan::Gemv(plan) => self.gemv(x.into(), &[w], &[out], n_tokens, plan, Epilogue::Add, &mut None),
        }
    }

    /// `Backend::gate_up_glu`: one launch of the matrix-vector kernels for both products where
    /// they take the step (their epilogue computes SwiGLU only).
    pub(super) fn gate_up_glu_products(
        &self,
        x: Input,
        [w_gate, w_up]: [&CudaWeight; 2],
        rows: GluRows,
        n_tokens: usize,
        act: Activation,
    ) -> Result<()> {
        let same_shape = (w_gate.ty, w_gate.n_in, w_gate.n_out) == (w_up.ty, w_up.n_in, w_up.n_out);
        match self.matmul_plan(w_gate, n_tokens) {
            MatmulPlan::Gemv(plan) if same_shape && act == Activation::Silu => self.gemv(
                x,
                &[w_gate, w_up],
                &[rows.out],
                n_tokens,
                plan,
                Epilogue::SwiGlu,
                &mut None,
            ),
            _ => gate_up_glu_in_steps(self, x, [w_gate, w_up], rows, n_tokens, act),
        }
    }

    /// The `Matrices` of a launch's parameter struct for `ws` (one type, at most `MAX_MATRICES`),
    /// writing token rows `first..first + count` of `outs` (with `Epilogue::SwiGlu`, ws is gate and
    /// up, and outs one output); and the blocks their rows need, a warp taking `rows_per_warp`
    /// rows of a matrix.
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
    /// `Epilogue::SwiGlu`, gate and up) in groups of up to 8 tokens, as `plan` (the first weight's)
    /// says: on int8 activations, quantized (and normalized) here unless `quantized` already holds
    /// them in the layout they read, else on the f32 rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv(
        &self,
        x: Input,
        ws: &[&CudaWeight],
        outs: &[BlockHandle],
        n_tokens: usize,
        plan: GemvPlan,
        epilogue: Epilogue,
        quantized: &mut Option<Quantized>,
    ) -> Result<()> {
        let w = ws[0];
        let suffix = Self::type_suffix(w.ty)?;
        let n_in = w.n_in as i32;
        let input = match plan {
            GemvPlan::Int8 { staging, normalizes } => GemvInput::Int8(match *quantized {
                Some(q) if q.interleaved == interleaves_activations(w.ty) => q,
                _ => {
                    let x = match normalizes {
                        true => x,
                        false => Input::Rows(self.input_rows(x, n_tokens, w.n_in)?),
                    };
                    *quantized.insert(self.quantize_activations(x, staging, n_tokens, w)?)
                }
            }),
            GemvPlan::F32 { normalizes } => match x {
                Input::RmsNormed { x, weight, eps, .. } if normalizes => GemvInput::Normed { x, weight, eps },
                _ => GemvInput::F32(self.input_rows(x, n_tokens, w.n_in)?),
            },
        };
        let glu = epilogue == Epilogue::SwiGlu;
        for (done, t) in token_groups(n_tokens) {
            // Q4_K's one-token integer kernels take two rows a warp and spread their blocks.
            let q4k_one_token = matches!(input, GemvInput::Int8(_)) && w.ty == GgmlType::Q4K && t == 1;
            let rows_per_warp = if q4k_one_token { Q4K_ROWS } else { 1 };
            let (mut mats, blocks) = self.matrices(ws, outs, epilogue, (done, t), rows_per_warp);
            // FP8 on the tensor cores: blocks of FP8_MMA_ROWS rows of one matrix, or with SwiGLU
            // half as many of gate's and up's.
            let fp8_mma = w.ty == GgmlType::Fp8 && self.paths.fp8_tensor_cores();
            let blocks = match (fp8_mma, glu) {
                (false, _) => blocks,
                (true, true) => w.n_out.div_ceil(kernels::FP8_MMA_ROWS / 2) as u32,
                (true, false) => ws
                    .iter()
                    .map(|w| w.n_out.div_ceil(kernels::FP8_MMA_ROWS))
                    .sum::<usize>() as u32,
            };
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
                    let params = GemvIntParams {
                        mats,
                        n_in,
                        xq: xqs,
                        xd: xds,
                    };
                    self.launch_shared(&name, (blocks, 1, 1), 256, shared, &params)?
                }
                GemvInput::F32(rows) => {
                    let xs = self.ptr(rows.slice(done * w.n_in * 4, t * w.n_in * 4));
                    let name = match fp8_mma {
                        true => kernels::gemv_fp8_mma_kernel(glu, false, t),
                        false => kernels::gemv_kernel(false, glu, suffix, t),
                    };
                    self.launch(&name, (blocks, 1, 1), 256, &GemvParams { mats, n_in, x: xs })?
                }
                GemvInput::Normed { x, weight, eps } => {
                    let name = match fp8_mma {
                        true => kernels::gemv_fp8_mma_kernel(glu, true, 1),
                        false => kernels::gemv_normed_kernel(glu, suffix),
                    };
                    let params = GemvNormedParams {
                        mats,
                        n_in,
                        x: self.ptr(x),
                        norm: self.ptr(weight),
                        eps,
                    };
                    self.launch(&name, (blocks, 1, 1), 256, &params)?
                }
            }
        }
        Ok(())
    }

    /// How the product of `w` over `n_tokens` runs: cuBLAS above `Paths::gemv_max_tokens`; else
    /// the matrix-vector kernels, on integers where the int8 staging is reserved and `w` is
    /// quantized (`Paths::int8_activations`) and large (see `INT_GEMV_MIN_N_IN`), else on f32
    /// rows, which they normalize themselves for one token of a small matrix where the paths
    /// fold norms (see `NORMED_GEMV_MAX_VALUES`; their float4 reads need rows of a multiple of 4
    /// values, and `upload_weight` admits only multiples of 32).
    pub(super) fn matmul_plan(&self, w: &CudaWeight, n_tokens: usize) -> MatmulPlan {
        if n_tokens > self.paths.gemv_max_tokens(w.ty) {
            return MatmulPlan::Gemm;
        }
        let large = w.n_in >= INT_GEMV_MIN_N_IN || w.n_in * w.n_out >= INT_GEMV_MIN_VALUES;
        let folds = self.paths.folds_norms();
        match self
            .int8_activations
            .filter(|_| self.paths.int8_activations(w.ty) && large)
        {
            Some(staging) => MatmulPlan::Gemv(GemvPlan::Int8 {
                staging,
                normalizes: folds,
            }),
            None => {
                let small = w.n_in * w.n_out <= NORMED_GEMV_MAX_VALUES && w.n_in <= kernels::GEMV_NORMED_MAX_IN;
                MatmulPlan::Gemv(GemvPlan::F32 {
                    normalizes: folds && n_tokens == 1 && small,
                })
            }
        }
    }

    /// Quantizes `n_tokens` rows of activations for `w` into `staging` (int8 values, f32 scale
    /// per 32) in the layout `w`'s kernels read, normalizing them first if `x` says so.
    pub(super) fn quantize_activations(
        &self,
        x: Input,
        staging: (BlockHandle, BlockHandle),
        n_tokens: usize,
        w: &CudaWeight,
    ) -> Result<Quantized> {
        self.quantize(x, staging, n_tokens, w, false)
    }

    /// `quantize_activations`, and the f32 rows `x` stands for: where it is `Input::RmsNormed`,
    /// normalized into its scratch in the same pass.
    pub(super) fn quantize_keeping_rows(
        &self,
        x: Input,
        staging: (BlockHandle, BlockHandle),
        n_tokens: usize,
        w: &CudaWeight,
    ) -> Result<(BlockHandle, Quantized)> {
        let rows = match x {
            Input::Rows(rows) => rows,
            Input::RmsNormed { scratch, .. } => scratch,
        };
        Ok((rows, self.quantize(x, staging, n_tokens, w, true)?))
    }

    fn quantize(
        &self,
        x: Input,
        (xq, xd): (BlockHandle, BlockHandle),
        n_tokens: usize,
        w: &CudaWeight,
        keep_rows: bool,
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
                    &QuantizeQ8Params {
                        x: self.ptr(x),
                        xq: xq_ptr,
                        xd: xd_ptr,
                        n: n as u64,
                        n_in: n_in as i32,
                        interleave,
                        start_next,
                    },
                )?
            }
            Input::RmsNormed {
                x,
                weight,
                eps,
                scratch,
            } => {
                let (kernel, threads) = if keep_rows {
                    norm_q8_rows_kernel(n_in)?
                } else {
                    norm_q8_kernel(n_in)?
                };
                self.launch(
                    kernel,
                    (n_tokens as u32, 1, 1),
                    threads,
                    &RmsNormQ8Params {
                        x: self.ptr(x),
                        w: self.ptr(weight),
                        xq: xq_ptr,
                        xd: xd_ptr,
                        rows: if keep_rows { self.ptr(scratch) } else { 0 },
                        dim: n_in as i32,
                        eps,
                        interleave,
                        start_next,
                    },
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

/// How one weight's product over a step runs (`matmul_plan`): through cuBLAS (`gemm`, on inputs
/// in `gemm_input`'s type), or on the matrix-vector kernels.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum MatmulPlan {
    Gemm,
    Gemv(GemvPlan),
}

/// The matrix-vector kernels' activations: int8, quantized into `staging` for them; or f32
/// rows. With `normalizes`, an `Input::RmsNormed` is normalized on the way (by the quantization,
/// or by the f32 kernels themselves); without, by `rms_norm` first.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum GemvPlan {
    Int8 {
        staging: (BlockHandle, BlockHandle),
        normalizes: bool,
    },
    F32 {
        normalizes: bool,
    },
}

impl MatmulPlan {
    /// Whether the kernels take an `Input::RmsNormed` as it is and normalize it themselves.
    fn normalizes_input(self) -> bool {
        matches!(
            self,
            MatmulPlan::Gemv(GemvPlan::Int8 { normalizes: true, .. } | GemvPlan::F32 { normalizes: true })
        )
    }
}

/// Activations quantized for the integer matrix-vector kernels: int8 values, f32 block scales,
/// and whether the values are interleaved (`interleaves_activations`). `by_quiet_kernel`: written
/// by a kernel that reads little memory after its wait (one-token attention, whose cache reads
/// come before it), so the product may copy more of its rows before its own wait (`copy_whole`
/// in matmul.cu).
#[derive(Clone, Copy)]
pub(super) struct Quantized {
    pub(super) xq: BlockHandle,
    pub(super) xd: BlockHandle,
    pub(super) interleaved: bool,
    pub(super) by_quiet_kernel: bool,
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
pub(super) enum Epilogue {
    Store,
    Add,
    SwiGlu,
}
