//! Greedy decoding with the device a step ahead of the host. Each step ends with its argmax,
//! which it leaves where the next step reads its input token (with that token's position), so the
//! host queues the step that runs token k before it has seen token k, and the device never waits
//! on the host's round trip (the copy back, the host's wake-up, the next step's inputs and launch:
//! about 20 us a token on the H200).

use super::{Llama, LogitRows, SeqStep, StepKind, Want};
use crate::backend::Backend;
use crate::model::kv_cache::PagePool;
use crate::model::KvCache;
use crate::{Error, Result};

/// One sequence decoded greedily (`axiom run` at temperature 0, `axiom bench`'s generation).
///
/// `kv` holds the prompt and every token returned but the last: the token a caller stops at is
/// never added (as [`crate::engine::generate`] never runs the token it ends on), and the step
/// queued for it is dropped.
pub struct GreedyDecode<'a, B: Backend> {
    model: &'a mut Llama<B>,
    /// Where the sequence's pages come from, a page at a time as it grows.
    pages: &'a mut PagePool,
    kv: &'a mut KvCache,
    /// The choice slot of the newest token, which the host has not seen; none once decoding has
    /// ended.
    newest: Option<usize>,
    /// The last token returned, which the newest step runs: it joins `kv` when the caller asks
    /// for the next.
    held: Option<u32>,
}

impl<'a, B: Backend> GreedyDecode<'a, B> {
    /// Runs `prompt` after what `kv` holds and queues the choice of the first token.
    pub fn new(model: &'a mut Llama<B>, pages: &'a mut PagePool, kv: &'a mut KvCache, prompt: &[u32]) -> Result<Self> {
        let last = prompt
            .len()
            .checked_sub(1)
            .ok_or_else(|| Error::InvalidArgument("the prompt has no tokens".into()))?;
        pages.reserve(kv, prompt.len())?;
        model.forward(prompt, kv, LogitRows::None, |_, _| {})?;
        pages.after_step(kv);
        let row = last % model.max_batch;
        model.choose_after(row, 0)?;
        Ok(GreedyDecode {
            model,
            pages,
            kv,
            newest: Some(0),
            held: None,
        })
    }

    /// Waits for the next token. With `run_it`, first queues the step that runs it (and chooses
    /// the one after), so the device has work while the host waits; without, decoding ends.
    pub fn next_token(&mut self, run_it: bool) -> Result<u32> {
        let newest = self
            .newest
            .take()
            .ok_or_else(|| Error::InvalidArgument("greedy decoding has ended".into()))?;
        if let Some(token) = self.held.take() {
            self.kv.push_tokens(&[token]);
            self.pages.after_step(self.kv);
        }
        if run_it {
            if let Err(e) = self.run_newest(1 - newest) {
                let _ = self.wait(newest);
                return Err(e);
            }
        }
        let token = self.wait(newest)?;
        self.held = run_it.then_some(token);
        Ok(token)
    }

    /// Queues the step that runs the token the last one left on the device, its choice into
    /// `slot`.
    fn run_newest(&mut self, slot: usize) -> Result<()> {
        self.pages.reserve(self.kv, 1)?;
        let step = SeqStep {
            kv: &mut *self.kv,
            tokens: &[0],
            want: Want::Nothing,
        };
        self.model.step(&mut [step], StepKind::Greedy { slot })?;
        self.newest = Some(slot);
        Ok(())
    }

    fn wait(&self, slot: usize) -> Result<u32> {
        self.model.backend.wait_choice(&self.model.choices[slot])
    }
}

impl<B: Backend> Drop for GreedyDecode<'_, B> {
    /// Waits for the dropped step (its token lands in memory the backend reuses) and gives back
    /// the page it may have taken.
    fn drop(&mut self) {
        if let Some(newest) = self.newest.take() {
            // An error here would have been the step's; the caller has already stopped.
            let _ = self.wait(newest);
        }
        let len = self.kv.len();
        self.pages.truncate(self.kv, len);
    }
}
