//! [`InProcess`]: the ranks of a group as threads of one process, meeting at a rendezvous in
//! host memory (a mutex and a condition variable). Each collective copies a rank's buffer to the
//! host, the last rank to arrive combines every rank's part in rank order, and each rank copies
//! the result back, so it runs over any backend's buffers. Rank 0 hands the others their work
//! over channels.

use super::communicator::{Collective, Communicator};
use crate::backend::{BlockHandle, Kernels};
use crate::{Error, Result};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One rank's end of an in-process group.
pub struct InProcess {
    rank: usize,
    meeting: Arc<Meeting>,
    /// On rank 0, where each other rank's work goes (emptied when the group stops).
    outboxes: Mutex<Vec<Sender<Vec<u32>>>>,
    /// On the other ranks, where their work comes from.
    inbox: Option<Receiver<Vec<u32>>>,
}

struct Meeting {
    size: usize,
    state: Mutex<State>,
    arrived: Condvar,
}

struct State {
    /// Collectives completed so far.
    generation: u64,
    /// The parts of the collective under way, by rank (empty vectors stand for ranks yet to come).
    parts: Vec<Vec<f32>>,
    asked: Vec<Option<Collective>>,
    waiting: usize,
    /// The last completed collective's result, read by each rank before any can start the next.
    result: std::result::Result<Arc<Vec<f32>>, String>,
    /// Why the group stopped, once it has.
    stopped: Option<String>,
}

impl InProcess {
    /// The `size` ranks of a new group, rank 0 first.
    pub fn group(size: usize) -> Result<Vec<InProcess>> {
        if size == 0 {
            return Err(Error::InvalidArgument("a group of 0 ranks".into()));
        }
        let meeting = Arc::new(Meeting {
            size,
            state: Mutex::new(State {
                generation: 0,
                parts: vec![Vec::new(); size],
                asked: vec![None; size],
                waiting: 0,
                result: Ok(Arc::new(Vec::new())),
                stopped: None,
            }),
            arrived: Condvar::new(),
        });
        let (outboxes, mut inboxes): (Vec<_>, Vec<_>) = (1..size).map(|_| channel()).unzip();
        let mut outboxes = Some(outboxes);
        Ok((0..size)
            .map(|rank| InProcess {
                rank,
                meeting: meeting.clone(),
                outboxes: Mutex::new(match rank {
                    0 => outboxes.take().unwrap_or_default(),
                    _ => Vec::new(),
                }),
                inbox: (rank > 0).then(|| inboxes.remove(0)),
            })
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.meeting
            .state
            .lock()
            .map_err(|_| Error::Backend("a rank of the tensor-parallel group panicked".into()))
    }

    /// Leaves this rank's `part` for `collective` and waits for every rank's: the last to
    /// arrive combines them, and each takes the result.
    fn meet(&self, collective: &Collective, part: Vec<f32>) -> Result<Arc<Vec<f32>>> {
        let mut state = self.lock()?;
        if let Some(reason) = &state.stopped {
            return Err(stopped(reason));
        }
        let generation = state.generation;
        state.parts[self.rank] = part;
        state.asked[self.rank] = Some(collective.clone());
        state.waiting += 1;
        if state.waiting == self.meeting.size {
            let asked = std::mem::replace(&mut state.asked, vec![None; self.meeting.size]);
            let parts = std::mem::replace(&mut state.parts, vec![Vec::new(); self.meeting.size]);
            state.result = match asked.iter().all(|a| *a == asked[0]) {
                true => Ok(Arc::new(asked[0].as_ref().map_or_else(Vec::new, |c| c.combine(&parts)))),
                false => Err(format!(
                    "the ranks of a tensor-parallel group asked for different collectives: {asked:?}"
                )),
            };
            state.waiting = 0;
            state.generation += 1;
            self.meeting.arrived.notify_all();
        } else {
            while state.generation == generation && state.stopped.is_none() {
                state = self
                    .meeting
                    .arrived
                    .wait(state)
                    .map_err(|_| Error::Backend("a rank of the tensor-parallel group panicked".into()))?;
            }
            if state.generation == generation {
                return Err(stopped(state.stopped.as_deref().unwrap_or_default()));
            }
        }
        match &state.result {
            Ok(result) => Ok(result.clone()),
            Err(e) => Err(Error::Backend(e.clone())),
        }
    }
}

fn stopped(reason: &str) -> Error {
    Error::Backend(format!("the tensor-parallel group stopped: {reason}"))
}

impl<B: Kernels + ?Sized> Communicator<B> for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.meeting.size
    }

    fn all_reduce_sum(&self, backend: &B, x: BlockHandle, n: usize) -> Result<()> {
        Collective::Sum { n }.on_host(backend, self.rank, [x, x], |c, part| self.meet(c, part))
    }

    fn all_gather(
        &self,
        backend: &B,
        part: BlockHandle,
        out: BlockHandle,
        rows: usize,
        widths: &[usize],
    ) -> Result<()> {
        if widths.len() != self.meeting.size {
            return Err(Error::InvalidArgument(format!(
                "{} widths for a group of {}",
                widths.len(),
                self.meeting.size
            )));
        }
        let collective = Collective::Gather {
            rows,
            widths: widths.to_vec(),
        };
        collective.on_host(backend, self.rank, [part, out], |c, part| self.meet(c, part))
    }

    fn abort(&self, reason: &str) {
        // A poisoned lock means a rank panicked holding it; the others fail on it already.
        if let Ok(mut state) = self.meeting.state.lock() {
            state.stopped.get_or_insert_with(|| reason.to_string());
            self.meeting.arrived.notify_all();
        }
        // The other ranks, waiting for work, see the group closed.
        if let Ok(mut outboxes) = self.outboxes.lock() {
            outboxes.clear();
        }
    }

    fn recordable(&self) -> bool {
        false
    }

    fn send_work(&self, work: &[u32]) -> Result<()> {
        let outboxes = self
            .outboxes
            .lock()
            .map_err(|_| Error::Backend("a rank of the tensor-parallel group panicked".into()))?;
        if outboxes.len() + 1 != self.meeting.size {
            return Err(Error::Backend("the tensor-parallel group has stopped".into()));
        }
        for (rank, outbox) in outboxes.iter().enumerate() {
            outbox
                .send(work.to_vec())
                .map_err(|_| Error::Backend(format!("rank {} of the tensor-parallel group has stopped", rank + 1)))?;
        }
        Ok(())
    }

    fn next_work(&self) -> Result<Option<Vec<u32>>> {
        let inbox = self
            .inbox
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("rank 0 hands out work; it takes none".into()))?;
        Ok(inbox.recv().ok())
    }
}
