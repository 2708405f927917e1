//! Tensor parallelism: a model's layers split across ranks (Megatron style), which meet in the
//! collectives of a [`Communicator`]. [`shard`] says what each rank holds; [`in_process`] runs
//! the ranks as threads of one process.

pub mod communicator;
pub mod in_process;
pub mod shard;

pub use communicator::Communicator;
pub use in_process::InProcess;
pub use shard::Shard;
