//! RMS norms (kernels/rms_norm.cu): their launchers, and the block sizes that hold a row in
//! registers.

use super::fp8_gemm::Fp8Activations;
use super::params::{RmsNorm16Params, RmsNormFp8Params, RmsNormPairParams, RmsNormParams};
use super::CudaBackend;
use crate::backend::{AttentionShape, BlockHandle};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// The most float4 a thread of the RMS norms holds (NORM_LOADS in rms_norm.cu).
const NORM_LOADS: usize = 4;

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
pub(super) fn norm_q8_kernel(dim: usize) -> Result<(&'static str, u32)> {
    Ok(if dim <= 4 * 1024 {
        ("rms_norm_q8_1", norm_block(dim, 1)?)
    } else {
        ("rms_norm_q8", norm_block(dim, NORM_Q8_LOADS)?)
    })
}

/// The kernel that normalizes decode rows of `dim` values into both f32 and int8 (a mixture
/// block's router reads the one, its experts the other), and its threads: a float4 a thread, more
/// for rows over 4096 values.
pub(super) fn norm_q8_rows_kernel(dim: usize) -> Result<(&'static str, u32)> {
    Ok(("rms_norm_q8_rows", norm_block(dim, 1)?))
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

impl CudaBackend {
    /// `Kernels::rms_norm`.
    pub(super) fn launch_rms_norm(
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
            (n_tokens as u32, 1, 1),
            norm_block(dim, 1)?,
            &RmsNormParams {
                x: self.ptr(x),
                w: self.ptr(weight),
                out: self.ptr(out),
                dim: dim as i32,
                eps,
            },
        )
    }

    /// `Backend::head_norms`: the query heads and the key heads in one launch.
    pub(super) fn launch_head_norms(
        &self,
        x: [BlockHandle; 2],
        w: [BlockHandle; 2],
        out: [BlockHandle; 2],
        n_tokens: usize,
        shape: AttentionShape,
        eps: f32,
    ) -> Result<()> {
        let (q_rows, k_rows) = (n_tokens * shape.n_heads, n_tokens * shape.n_kv_heads);
        if q_rows + k_rows == 0 {
            return Ok(()); // a grid is never empty
        }
        self.launch(
            "rms_norm_pair",
            ((q_rows + k_rows) as u32, 1, 1),
            norm_block(shape.head_dim, 1)?,
            &RmsNormPairParams {
                x: x.map(|b| self.ptr(b)),
                w: w.map(|b| self.ptr(b)),
                out: out.map(|b| self.ptr(b)),
                split: q_rows as u32,
                dim: shape.head_dim as i32,
                eps,
            },
        )
    }

    /// RMS-normalizes `n_tokens` rows of `dim` into the cuBLAS activation staging, as `ty` (f16 or
    /// bf16). `dim` is a weight's row length, so a multiple of 32, as the kernel's float4 reads
    /// need. With `fp8`, quantized there for the FP8 tensor cores in the same pass.
    pub(super) fn rms_norm_16bit(
        &self,
        x: BlockHandle,
        weight: BlockHandle,
        eps: f32,
        n_tokens: usize,
        dim: usize,
        ty: GgmlType,
        fp8: Option<Fp8Activations>,
    ) -> Result<()> {
        let (_, x_stage) = self.cublas_staging()?;
        if n_tokens * dim * 2 > x_stage.len {
            return Err(Error::Backend(format!(
                "{n_tokens} x {dim} activations exceed the cuBLAS staging of {} bytes",
                x_stage.len
            )));
        }
        let block = norm_block(dim, NORM_LOADS)?;
        let Some(fp8) = fp8 else {
            let params = RmsNorm16Params {
                x: self.ptr(x),
                w: self.ptr(weight),
                out: self.ptr(x_stage),
                dim: dim as i32,
                eps,
                kind: ty.id() as i32,
            };
            return self.launch("rms_norm_16", (n_tokens as u32, 1, 1), block, &params);
        };
        let params = RmsNormFp8Params {
            x: self.ptr(x),
            w: self.ptr(weight),
            out: self.ptr(x_stage),
            codes: self.ptr(fp8.codes),
            scales: self.ptr(fp8.scales),
            dim: dim as i32,
            eps,
            kind: ty.id() as i32,
            n_tokens: n_tokens as i32,
            cols: fp8.cols as i32,
        };
        self.launch("rms_norm_16_fp8", (fp8.cols as u32, 1, 1), block, &params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
