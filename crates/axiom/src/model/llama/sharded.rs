//! A model split across the ranks of a tensor-parallel group. Every rank is a [`Llama`] of its
//! share ([`Shard`]) running the same layer loop; they meet in its collectives. Rank 0 is the
//! model the engine drives: each step it packs, it hands to the other ranks (threads of their
//! own, in this process) before running it, so every rank runs the same steps in the same order.

use super::{Llama, LoadOptions, StepKind};
use crate::backend::Backend;
use crate::model::kv_cache::PagePool;
use crate::model::weights::TensorSource;
use crate::model::ModelConfig;
use crate::parallel::{Communicator, Rank, Shard};
use crate::{Error, Result};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

/// What rank 0 hands the other ranks: each is a call every rank makes alike.
#[derive(Clone)]
pub(super) enum Work {
    /// `run_packed` of a step of `n` tokens whose inputs rank 0 packed.
    Step { packed: Vec<u32>, n: usize, kind: StepKind },
    /// `lm_head` of each run of rows (first row, rows).
    Heads(Vec<(usize, usize)>),
    /// `choose_after`.
    Choose { row: usize, slot: usize },
}

/// A rank's place in its group.
pub(super) struct Group<B: Backend> {
    pub comm: Box<dyn Communicator<B>>,
    /// Every rank's count of vocabulary rows, which the LM head's logits are gathered in.
    pub vocab_widths: Vec<usize>,
    /// On rank 0, the other ranks.
    peers: Vec<Peer>,
}

/// Another rank's thread, and where to send it work.
struct Peer {
    work: Option<Sender<Work>>,
    thread: Option<JoinHandle<()>>,
}

impl<B: Backend> Group<B> {
    pub fn new(comm: Box<dyn Communicator<B>>, vocab_widths: Vec<usize>) -> Self {
        Group {
            comm,
            vocab_widths,
            peers: Vec::new(),
        }
    }
}

impl<B: Backend> Drop for Group<B> {
    /// Stops the group (a rank unwinding from a panic frees those waiting on it), then lets the
    /// other ranks' threads finish.
    fn drop(&mut self) {
        self.comm.abort(&format!("rank {} stopped", self.comm.rank()));
        for peer in &mut self.peers {
            peer.work = None;
            if let Some(thread) = peer.thread.take() {
                // A rank that panicked has already stopped the group; nothing is left to do.
                let _ = thread.join();
            }
        }
    }
}

impl<B: Backend> Llama<B> {
    /// Hands the other ranks `work`, where this is rank 0 of a group.
    pub(super) fn share(&self, work: impl FnOnce(&Self) -> Work) -> Result<()> {
        let Some(group) = self.group.as_ref().filter(|g| !g.peers.is_empty()) else {
            return Ok(());
        };
        let work = work(self);
        for (rank, peer) in group.peers.iter().enumerate() {
            let sent = peer.work.as_ref().is_some_and(|w| w.send(work.clone()).is_ok());
            if !sent {
                // Those already sent it would wait for this rank in its first collective.
                let stopped = format!("rank {} of the tensor-parallel group has stopped", rank + 1);
                return self.stop_on_error(Err(Error::Backend(stopped)));
            }
        }
        Ok(())
    }

    /// Passes `result` on, stopping the group first if it is an error, so that no rank waits
    /// for this one in a collective it will not reach.
    pub(super) fn stop_on_error<T>(&self, result: Result<T>) -> Result<T> {
        if let (Err(e), Some(group)) = (&result, &self.group) {
            group.comm.abort(&format!("rank {}: {e}", group.comm.rank()));
        }
        result
    }
}

impl<B: Backend + 'static> Llama<B>
where
    Llama<B>: Send,
{
    /// Loads the model split over `ranks` (`ranks[r]` rank r of their group), as [`Shard`]
    /// splits it. Returns rank 0, which runs the others on threads of their own and which the
    /// engine drives as any model, with the pool of pages every rank's KV cache has.
    pub fn load_sharded<S: TensorSource + ?Sized>(
        source: &S,
        config: ModelConfig,
        ranks: Vec<Rank<B>>,
        options: LoadOptions,
    ) -> Result<(Llama<B>, PagePool)> {
        let size = ranks.len();
        let mut shards = Vec::with_capacity(size);
        for (i, rank) in ranks.iter().enumerate() {
            let (r, group) = (rank.comm.rank(), rank.comm.size());
            if (r, group) != (i, size) {
                return Err(Error::InvalidArgument(format!(
                    "rank {i} of the {size} given is rank {r} of a group of {group}"
                )));
            }
            shards.push(Shard::new(&config, i, size)?);
        }
        let mut models = Vec::with_capacity(size);
        let mut pool = None;
        for (Rank { backend, comm }, shard) in ranks.into_iter().zip(&shards) {
            let (model, pages) = Self::load_shard(source, config.clone(), shard, Some(comm), backend, options)?;
            pool.get_or_insert(pages);
            models.push(model);
        }
        let mut ranks = models.into_iter();
        let (Some(mut first), Some(pool)) = (ranks.next(), pool) else {
            return Err(Error::InvalidArgument("a model split over 0 ranks".into()));
        };
        let mut peers = Vec::with_capacity(size - 1);
        for (i, model) in ranks.enumerate() {
            let (work, inbox) = channel();
            let thread = std::thread::Builder::new()
                .name(format!("axiom-rank-{}", i + 1))
                .spawn(move || serve(model, inbox))
                .map_err(Error::io(format!("starting rank {}", i + 1)))?;
            peers.push(Peer {
                work: Some(work),
                thread: Some(thread),
            });
        }
        if let Some(group) = first.group.as_mut() {
            group.peers = peers;
        }
        Ok((first, pool))
    }
}

/// A rank other than 0: runs the work rank 0 hands it until rank 0 is dropped, or stops the
/// group at its first error.
fn serve<B: Backend>(mut model: Llama<B>, inbox: Receiver<Work>) {
    for work in inbox {
        let done = match work {
            Work::Step { packed, n, kind } => {
                model.inputs.packed = packed;
                model.run_packed(n, kind)
            }
            Work::Heads(runs) => runs.into_iter().try_for_each(|(first, n)| model.lm_head(first, n)),
            Work::Choose { row, slot } => model.choose(row, slot).and_then(|_| model.chosen(row, slot)),
        };
        if model.stop_on_error(done).is_err() {
            return;
        }
    }
}
