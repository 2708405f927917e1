//! CUDA graphs: decode steps recorded from the stream once and replayed, where every matmul of the
//! step runs on our own kernels.

use super::device::driver_error;
use super::CudaBackend;
use crate::{Error, Result};
use cudarc::driver::sys;

impl CudaBackend {
    /// `Kernels::begin_capture`.
    pub(super) fn begin_graph(&self, n_tokens: usize) -> Result<bool> {
        // Steps whose matmuls go through cuBLAS are not recorded.
        if n_tokens > self.capture_max_tokens {
            return Ok(false);
        }
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_error("graph capture"))?;
        Ok(true)
    }

    /// `Kernels::end_capture`.
    pub(super) fn end_graph(&self) -> Result<usize> {
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver_error("graph capture"))?
            .ok_or_else(|| Error::Backend("graph capture recorded nothing".into()))?;
        let mut graphs = self.graphs.borrow_mut();
        graphs.push(graph);
        Ok(graphs.len() - 1)
    }

    /// `Kernels::replay`.
    pub(super) fn launch_graph(&self, graph: usize) -> Result<()> {
        let graphs = self.graphs.borrow();
        let g = graphs
            .get(graph)
            .ok_or_else(|| Error::Backend(format!("no graph {graph}")))?;
        g.launch().map_err(driver_error("graph launch"))
    }
}
