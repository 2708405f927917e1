//! Tensor parallelism: a model's layers split across ranks (Megatron style), which meet in the
//! collectives of a [`Communicator`]. [`shard`] says what each rank holds; [`in_process`] runs
//! the ranks as threads of one process, [`tcp`] as processes meeting over TCP.

pub mod communicator;
pub mod in_process;
pub mod shard;
pub mod tcp;

pub use communicator::Communicator;
pub use in_process::InProcess;
pub use shard::Shard;
pub use tcp::Tcp;

use crate::backend::Kernels;
use crate::Result;

/// One rank of a group: the backend it computes on and its end of the group's communicator.
pub struct Rank<B: Kernels> {
    pub backend: B,
    pub comm: Box<dyn Communicator<B>>,
}

impl<B: Kernels> Rank<B> {
    /// A rank on each of `backends`, in that order, joined in one in-process group.
    pub fn in_process(backends: Vec<B>) -> Result<Vec<Rank<B>>> {
        let comms = InProcess::group(backends.len())?;
        Ok(backends
            .into_iter()
            .zip(comms)
            .map(|(backend, comm)| Rank {
                backend,
                comm: Box::new(comm),
            })
            .collect())
    }
}
