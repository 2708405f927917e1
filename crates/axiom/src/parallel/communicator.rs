//! [`Communicator`]: the collectives one rank of a tensor-parallel group takes part in, over its
//! backend's buffers, so that an implementation may move the data through the host (the
//! in-process and TCP ones) or leave it on the device (NCCL on CUDA); and the work rank 0 hands
//! the other ranks, so that they run the same steps.

use crate::backend::{BlockHandle, Kernels};
use crate::Result;
use std::ops::Deref;

/// One rank's end of a group of `size()` ranks that run the same steps in lockstep. Every rank
/// calls the same collectives in the same order; each call returns once every rank has made it.
pub trait Communicator<B: Kernels + ?Sized>: Send {
    /// This rank's index, from 0.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// `x` (`n` f32 on `backend`) becomes the sum of every rank's `x`, every rank holding the
    /// same bits (the host communicators add in rank order).
    fn all_reduce_sum(&self, backend: &B, x: BlockHandle, n: usize) -> Result<()>;
    /// Every rank's columns side by side: `out` (`rows` rows of `widths.iter().sum()` f32) gets
    /// rank r's `part` (`rows` rows of `widths[r]`) as its columns from `widths[..r].sum()` on.
    fn all_gather(&self, backend: &B, part: BlockHandle, out: BlockHandle, rows: usize, widths: &[usize])
        -> Result<()>;
    /// Stops the group: a collective any rank is waiting in, and every later one, fails with
    /// `reason`, so that a rank that fails does not leave the others waiting for it.
    fn abort(&self, reason: &str);
    /// Whether the collectives only queue work on the backend's stream, so that a step may be
    /// recorded in the backend's graphs with them inside; one that waits on the host cannot be.
    fn recordable(&self) -> bool;
    /// On rank 0: hands every other rank `work` (what it runs next, encoded), in order.
    fn send_work(&self, work: &[u32]) -> Result<()>;
    /// On any other rank: the next work rank 0 handed out, or `None` once rank 0 has closed or
    /// stopped the group between steps.
    fn next_work(&self) -> Result<Option<Vec<u32>>>;
}

/// What a collective does with every rank's part (host memory), and the result, in rank order:
/// shared by the communicators that meet on the host.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Collective {
    Sum { n: usize },
    Gather { rows: usize, widths: Vec<usize> },
}

impl Collective {
    /// Values rank `rank` contributes.
    pub fn part_len(&self, rank: usize) -> usize {
        match self {
            Collective::Sum { n } => *n,
            Collective::Gather { rows, widths } => rows * widths.get(rank).copied().unwrap_or(0),
        }
    }

    /// Values of the result.
    pub fn result_len(&self) -> usize {
        match self {
            Collective::Sum { n } => *n,
            Collective::Gather { rows, widths } => rows * widths.iter().sum::<usize>(),
        }
    }

    /// This collective through host memory, as the communicators that meet there run it:
    /// `rank`'s part read from `part`, every rank's combined by `meet`, the result written to
    /// `out`.
    pub fn on_host<B: Kernels + ?Sized, R>(
        &self,
        backend: &B,
        rank: usize,
        [part, out]: [BlockHandle; 2],
        meet: impl FnOnce(&Collective, Vec<f32>) -> Result<R>,
    ) -> Result<()>
    where
        R: Deref,
        R::Target: AsRef<[f32]>,
    {
        let mut values = vec![0f32; self.part_len(rank)];
        backend.read_f32(part, &mut values)?;
        let result = meet(self, values)?;
        backend.write_f32(out, (*result).as_ref())
    }

    /// The result of the parts, in rank order.
    pub fn combine(&self, parts: &[Vec<f32>]) -> Vec<f32> {
        match self {
            Collective::Sum { n } => {
                let mut sum = vec![0f32; *n];
                for part in parts {
                    sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
                }
                sum
            }
            Collective::Gather { rows, widths } => {
                let total: usize = widths.iter().sum();
                let mut out = vec![0f32; rows * total];
                let mut first = 0;
                for (part, &width) in parts.iter().zip(widths) {
                    for (row, values) in out.chunks_exact_mut(total).zip(part.chunks_exact(width)) {
                        row[first..first + width].copy_from_slice(values);
                    }
                    first += width;
                }
                out
            }
        }
    }
}
