//! A model split across the ranks of a tensor-parallel group. Every rank is a [`Llama`] of its
//! share ([`Shard`]) running the same layer loop; they meet in its collectives. Rank 0 is the
//! model the engine drives: each step it packs, it hands to the other ranks (through the
//! communicator: threads of this process, or other processes) before running it, so every rank
//! runs the same steps in the same order.

use super::{Llama, LoadOptions, StepKind};
use crate::backend::Backend;
use crate::model::kv_cache::PagePool;
use crate::model::weights::TensorSource;
use crate::model::ModelConfig;
use crate::parallel::{Communicator, Rank, Shard};
use crate::{Error, Result};
use std::thread::JoinHandle;

/// What rank 0 hands the other ranks: each is a call every rank makes alike.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Work {
    /// `run_packed` of a step of `n` tokens whose inputs rank 0 packed.
    Step { packed: Vec<u32>, n: usize, kind: StepKind },
    /// `lm_head` of each run of rows (first row, rows).
    Heads(Vec<(usize, usize)>),
    /// `choose_after`.
    Choose { row: usize, slot: usize },
}

impl Work {
    /// As words, for the communicator to carry: a tag, then the fields.
    fn encode(&self) -> Vec<u32> {
        let word = |x: usize| x as u32;
        match self {
            Work::Step { packed, n, kind } => {
                let slot = match kind {
                    StepKind::Host => u32::MAX,
                    StepKind::Greedy { slot } => word(*slot),
                };
                [&[0, word(*n), slot][..], packed].concat()
            }
            Work::Heads(runs) => std::iter::once(1)
                .chain(runs.iter().flat_map(|&(first, n)| [word(first), word(n)]))
                .collect(),
            Work::Choose { row, slot } => vec![2, word(*row), word(*slot)],
        }
    }

    fn decode(words: &[u32]) -> Result<Work> {
        let at = |i: usize| words.get(i).map(|&w| w as usize);
        let work = match (words.first(), at(1), at(2)) {
            (Some(0), Some(n), Some(slot)) => Some(Work::Step {
                packed: words[3..].to_vec(),
                n,
                kind: match words[2] {
                    u32::MAX => StepKind::Host,
                    _ => StepKind::Greedy { slot },
                },
            }),
            (Some(1), _, _) if words.len() % 2 == 1 => Some(Work::Heads(
                words[1..]
                    .chunks_exact(2)
                    .map(|r| (r[0] as usize, r[1] as usize))
                    .collect(),
            )),
            (Some(2), Some(row), Some(slot)) if words.len() == 3 => Some(Work::Choose { row, slot }),
            _ => None,
        };
        work.ok_or_else(|| {
            Error::Backend(format!(
                "rank 0 handed out work this rank cannot read ({} words)",
                words.len()
            ))
        })
    }
}

/// A rank's place in its group.
pub(super) struct Group<B: Backend> {
    pub comm: Box<dyn Communicator<B>>,
    /// Every rank's count of vocabulary rows, which the LM head's logits are gathered in.
    pub vocab_widths: Vec<usize>,
    /// On rank 0, the threads of the other ranks run in this process.
    threads: Vec<JoinHandle<()>>,
}

impl<B: Backend> Group<B> {
    pub fn new(comm: Box<dyn Communicator<B>>, vocab_widths: Vec<usize>) -> Self {
        Group {
            comm,
            vocab_widths,
            threads: Vec::new(),
        }
    }
}

impl<B: Backend> Drop for Group<B> {
    /// Stops the group (a rank unwinding from a panic frees those waiting on it; those waiting
    /// for work see it closed), then lets the other ranks' threads finish.
    fn drop(&mut self) {
        self.comm.abort(&format!("rank {} stopped", self.comm.rank()));
        for thread in self.threads.drain(..) {
            // A rank that panicked has already stopped the group; nothing is left to do.
            let _ = thread.join();
        }
    }
}

impl<B: Backend> Llama<B> {
    /// Hands the other ranks `work`, where this is rank 0 of a group.
    pub(super) fn share(&self, work: impl FnOnce(&Self) -> Work) -> Result<()> {
        let Some(group) = self.group.as_ref().filter(|g| g.comm.rank() == 0 && g.comm.size() > 1) else {
            return Ok(());
        };
        // Those already handed it would wait for a rank that missed it in its first collective.
        let sent = group.comm.send_work(&work(self).encode());
        self.stop_on_error(sent)
    }

    /// Passes `result` on, stopping the group first if it is an error, so that no rank waits
    /// for this one in a collective it will not reach.
    pub(super) fn stop_on_error<T>(&self, result: Result<T>) -> Result<T> {
        if let (Err(e), Some(group)) = (&result, &self.group) {
            group.comm.abort(&format!("rank {}: {e}", group.comm.rank()));
        }
        result
    }

    /// On a rank other than 0: runs the work rank 0 hands out until rank 0 closes the group, or
    /// stops the group at its first error and returns it.
    pub fn follow(mut self) -> Result<()> {
        let Some(group) = self.group.as_ref().filter(|g| g.comm.rank() > 0) else {
            return Err(Error::InvalidArgument(
                "only a rank other than 0 of a tensor-parallel group follows rank 0".into(),
            ));
        };
        let rank = group.comm.rank();
        while let Some(words) = group_of(&self)?.comm.next_work()? {
            let done = Work::decode(&words).and_then(|work| self.run_work(work));
            self.stop_on_error(done)
                .map_err(|e| Error::Backend(format!("rank {rank} of the tensor-parallel group: {e}")))?;
        }
        Ok(())
    }

    fn run_work(&mut self, work: Work) -> Result<()> {
        match work {
            Work::Step { packed, n, kind } => {
                if packed.len() > self.inputs.block.len / 4 {
                    return Err(Error::Backend(format!(
                        "rank 0 packed {} step inputs where this rank holds {}: every rank must load the model alike",
                        packed.len(),
                        self.inputs.block.len / 4
                    )));
                }
                self.inputs.packed = packed;
                self.run_packed(n, kind)
            }
            Work::Heads(runs) => runs.into_iter().try_for_each(|(first, n)| self.lm_head(first, n)),
            Work::Choose { row, slot } => self.choose(row, slot).and_then(|_| self.chosen(row, slot)),
        }
    }
}

fn group_of<B: Backend>(model: &Llama<B>) -> Result<&Group<B>> {
    model
        .group
        .as_ref()
        .ok_or_else(|| Error::Backend("a rank without its group".into()))
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
        let mut threads = Vec::with_capacity(size - 1);
        for (i, model) in ranks.enumerate() {
            let thread = std::thread::Builder::new()
                .name(format!("axiom-rank-{}", i + 1))
                .spawn(move || {
                    // An error has stopped the group, which tells rank 0 why.
                    let _ = model.backend.enter_thread().and_then(|_| model.follow());
                })
                .map_err(Error::io(format!("starting rank {}", i + 1)))?;
            threads.push(thread);
        }
        if let Some(group) = first.group.as_mut() {
            group.threads = threads;
        }
        Ok((first, pool))
    }
}

impl<B: Backend> Llama<B> {
    /// Loads this process's one rank of a group whose other ranks are other processes (loading
    /// the same model with the same options): rank 0 is the model the engine drives, any other
    /// [`follow`](Llama::follow)s it. The ranks compare what they loaded, and a rank that
    /// differs is refused by name.
    pub fn load_rank<S: TensorSource + ?Sized>(
        source: &S,
        config: ModelConfig,
        rank: Rank<B>,
        options: LoadOptions,
    ) -> Result<(Llama<B>, PagePool)> {
        let Rank { backend, comm } = rank;
        let shard = Shard::new(&config, comm.rank(), comm.size())?;
        let (mut model, pool) = Self::load_shard(source, config, &shard, Some(comm), backend, options)?;
        let checked = model.check_alike(&pool);
        model.stop_on_error(checked)?;
        Ok((model, pool))
    }

    /// Gathers every rank's model and cache shape and refuses a group whose ranks differ.
    fn check_alike(&mut self, pool: &PagePool) -> Result<()> {
        let c = &self.config;
        let shape = [
            c.n_layers,
            c.dim,
            c.vocab_size,
            c.n_heads,
            self.max_batch,
            self.max_seqs,
            self.cache.table_width,
            pool.usage().total,
        ]
        .map(|x| x as f32);
        let group = group_of(self)?;
        let size = group.comm.size();
        let s = &self.scratch;
        // Small enough for the logits' buffers, whose width is the vocabulary's share.
        let (part, all) = (
            s.logits_part.slice(0, shape.len() * 4),
            s.logits.slice(0, shape.len() * 4 * size),
        );
        self.backend.write_f32(part, &shape)?;
        group
            .comm
            .all_gather(&self.backend, part, all, 1, &vec![shape.len(); size])?;
        let mut every = vec![0f32; shape.len() * size];
        self.backend.read_f32(all, &mut every)?;
        match every.chunks_exact(shape.len()).position(|theirs| theirs != shape) {
            None => Ok(()),
            Some(rank) => Err(Error::InvalidArgument(format!(
                "rank {rank} of the tensor-parallel group loaded another model or other options \
                 (layers, width, vocabulary, heads, batch, sequences, table width, pages: {:?} here, {:?} there); \
                 give every rank the same model and flags",
                shape,
                &every[rank * shape.len()..(rank + 1) * shape.len()]
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{StepKind, Work};

    #[test]
    fn work_reads_back_as_written_and_garbage_is_refused() {
        let works = [
            Work::Step {
                packed: vec![7, 0, u32::MAX, 3],
                n: 2,
                kind: StepKind::Host,
            },
            Work::Step {
                packed: Vec::new(),
                n: 1,
                kind: StepKind::Greedy { slot: 1 },
            },
            Work::Heads(vec![(0, 3), (5, 1)]),
            Work::Heads(Vec::new()),
            Work::Choose { row: 4, slot: 0 },
        ];
        for work in works {
            assert_eq!(Work::decode(&work.encode()).ok(), Some(work));
        }
        for garbage in [&[][..], &[9], &[0, 1], &[1, 2], &[2, 1, 0, 0]] {
            assert!(Work::decode(garbage).is_err(), "{garbage:?}");
        }
    }
}
