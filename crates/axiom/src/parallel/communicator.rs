//! [`Communicator`]: the collectives one rank of a tensor-parallel group takes part in, over its
//! backend's buffers, so that an implementation may move the data through the host (the
//! in-process one) or leave it on the device (NCCL on CUDA).

use crate::backend::{BlockHandle, Kernels};
use crate::Result;

/// One rank's end of a group of `size()` ranks that run the same steps in lockstep. Every rank
/// calls the same collectives in the same order; each call returns once every rank has made it.
pub trait Communicator<B: Kernels + ?Sized>: Send {
    /// This rank's index, from 0.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// `x` (`n` f32 on `backend`) becomes the sum of every rank's `x`, added in rank order so
    /// that every rank holds the same bits.
    fn all_reduce_sum(&self, backend: &B, x: BlockHandle, n: usize) -> Result<()>;
    /// Every rank's columns side by side: `out` (`rows` rows of `widths.iter().sum()` f32) gets
    /// rank r's `part` (`rows` rows of `widths[r]`) as its columns from `widths[..r].sum()` on.
    fn all_gather(&self, backend: &B, part: BlockHandle, out: BlockHandle, rows: usize, widths: &[usize])
        -> Result<()>;
    /// Stops the group: a collective any rank is waiting in, and every later one, fails with
    /// `reason`, so that a rank that fails does not leave the others waiting for it.
    fn abort(&self, reason: &str);
}
