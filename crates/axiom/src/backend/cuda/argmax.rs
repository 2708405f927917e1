//! Greedy choice on the device (kernels/argmax.cu): row-wise argmax, and the mapped host slots a
//! queued choice is written to, so that the host waits for that choice alone.

use super::device::{driver_error, Pinned};
use super::params::ArgmaxParams;
use super::CudaBackend;
use crate::backend::{BlockHandle, NextInput};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// Rows one `argmax` launch takes at most (it keeps a key and a count for each).
pub(super) const ARGMAX_ROWS: usize = 32;

/// Its blocks' threads and the values each block takes (ARGMAX_THREADS, ARGMAX_PER_BLOCK in
/// kernels/argmax.cu).
const ARGMAX_THREADS: u32 = 256;
const ARGMAX_PER_BLOCK: usize = 2048;

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

impl ChoiceSlot {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<ChoiceSlot> {
        let (host, device) = Pinned::mapped(ctx, 1)?;
        let done = ctx.new_event(None).map_err(driver_error("event"))?;
        Ok(ChoiceSlot { host, device, done })
    }

    /// Marks the choice queued on `stream` so far.
    pub(super) fn mark(&self, stream: &CudaStream) -> Result<()> {
        self.done.record(stream).map_err(driver_error("event"))
    }

    /// Waits for the marked choice and reads it.
    pub(super) fn wait(&self) -> Result<u32> {
        self.done.synchronize().map_err(driver_error("synchronize"))?;
        Ok(self.host[0])
    }
}

impl CudaBackend {
    /// `argmax` of `rows` rows (at most ARGMAX_ROWS) at device addresses, within the bits at
    /// `allowed` where it is not 0, the indices also to `chosen` where it is not 0; a greedy
    /// choice's (`next`) writes its position too.
    #[allow(
        clippy::too_many_arguments,
        reason = "the kernel's parameters, named at the one call of each kind"
    )]
    fn launch_argmax(
        &self,
        x: u64,
        allowed: u64,
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
            &ArgmaxParams {
                rows: x,
                n,
                allowed,
                outs: out,
                chosen,
                chosen_at,
                position,
                keys,
                arrivals,
            },
        )
    }

    /// `Kernels::argmax`, in launches of at most `ARGMAX_ROWS` rows.
    pub(super) fn argmax_rows(
        &self,
        x: BlockHandle,
        out: BlockHandle,
        n_rows: usize,
        width: usize,
        allowed: Option<BlockHandle>,
    ) -> Result<()> {
        for first in (0..n_rows).step_by(ARGMAX_ROWS) {
            let rows = (n_rows - first).min(ARGMAX_ROWS);
            let x = self.ptr(x) + (first * width * 4) as u64;
            let allowed = allowed.map_or(0, |a| self.ptr(a) + (first * width.div_ceil(32) * 4) as u64);
            self.launch_argmax(x, allowed, self.ptr(out) + first as u64 * 4, rows, width, 0, None)?;
        }
        Ok(())
    }

    /// `Kernels::queue_argmax`.
    pub(super) fn queue_choice(&self, x: BlockHandle, next: NextInput, width: usize, slot: &ChoiceSlot) -> Result<()> {
        self.launch_argmax(self.ptr(x), 0, self.ptr(next.token), 1, width, slot.device, Some(next))
    }
}
