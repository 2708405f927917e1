//! Elementwise kernels on f32 rows (kernels/elementwise.cu): residual adds, biases, gated
//! activations, scaling and capping.

use super::launch::blocks_for;
use super::params::{AddBiasParams, AddParams, GluParams, ScaleParams};
use super::CudaBackend;
use crate::backend::{Activation, BlockHandle};
use crate::Result;

impl CudaBackend {
    /// `Kernels::add`.
    pub(super) fn launch_add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        self.launch(
            "add",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &AddParams {
                x: self.ptr(x),
                y: self.ptr(y),
                n: n as u64,
            },
        )
    }

    /// `Kernels::add_bias`.
    pub(super) fn launch_add_bias(
        &self,
        x: BlockHandle,
        bias: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()> {
        let (n, width) = ((n_tokens * width) as u64, width as u64);
        self.launch(
            "add_bias",
            (blocks_for(n as usize, 256).min(4096), 1, 1),
            256,
            &AddBiasParams {
                x: self.ptr(x),
                bias: self.ptr(bias),
                n,
                width,
            },
        )
    }

    /// `Kernels::glu`.
    pub(super) fn launch_glu(
        &self,
        gate: BlockHandle,
        up: BlockHandle,
        out: BlockHandle,
        n: usize,
        act: Activation,
    ) -> Result<()> {
        self.launch(
            "glu",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &GluParams {
                gate: self.ptr(gate),
                up: self.ptr(up),
                out: self.ptr(out),
                n: n as u64,
                act: act.code() as i32,
            },
        )
    }

    /// `Kernels::scale` (`"scale"`) and `Kernels::softcap` (`"softcap"`, the cap as `factor`).
    pub(super) fn launch_scale(&self, kernel: &str, x: BlockHandle, factor: f32, n: usize) -> Result<()> {
        self.launch(
            kernel,
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &ScaleParams {
                x: self.ptr(x),
                n: n as u64,
                factor,
            },
        )
    }
}
