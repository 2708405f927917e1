//! Greedy decoding with the device a step ahead of the host. Each step leaves its argmax where
//! the next step reads its input token, so the host queues the step that runs token k before it
//! has seen token k, and the device never waits on the host's round trip (the copy back, the
//! host's wake-up, the next step's inputs and launch: about 20 us a token on the H200).

use super::{Ids, Llama, LogitRows, SeqStep, Want};
use crate::backend::Backend;
use crate::model::KvCache;
use crate::{Error, Result};

/// One sequence decoded greedily (`axiom run` at temperature 0, `axiom bench`'s generation).
///
/// `kv` holds the prompt and every token returned but the last: the token a caller stops at is
/// never added (as [`crate::engine::generate`] never runs the token it ends on), and the step
/// queued for it is dropped.
pub struct GreedyDecode<'a, B: Backend> {
    model: &'a mut Llama<B>,
    kv: &'a mut KvCache,
    /// The newest token, which the host has not seen; none once decoding has ended.
    newest: Option<B::PendingArgmax>,
    /// The last token returned, which the newest step runs: it joins `kv` when the caller asks
    /// for the next.
    held: Option<u32>,
}

impl<'a, B: Backend> GreedyDecode<'a, B> {
    /// Runs `prompt` after what `kv` holds and queues the choice of the first token.
    pub fn new(model: &'a mut Llama<B>, kv: &'a mut KvCache, prompt: &[u32]) -> Result<Self> {
        let last = prompt
            .len()
            .checked_sub(1)
            .ok_or_else(|| Error::InvalidArgument("the prompt has no tokens".into()))?;
        model.forward(prompt, kv, LogitRows::None, |_, _| {})?;
        let newest = model.choose_on_device(last % model.max_batch)?;
        Ok(GreedyDecode {
            model,
            kv,
            newest: Some(newest),
            held: None,
        })
    }

    /// Tokens the sequence holds before the next one: `kv`'s and the last one returned.
    pub fn sequence_len(&self) -> usize {
        self.kv.len() + usize::from(self.held.is_some())
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
            self.model.pages.index_full_pages(self.kv);
        }
        if run_it {
            if let Err(e) = self.run_newest() {
                let _ = self.model.backend.wait_argmax(newest);
                return Err(e);
            }
        }
        let token = self.model.backend.wait_argmax(newest)?;
        self.held = run_it.then_some(token);
        Ok(token)
    }

    /// Queues the step that runs the token the last one left on the device.
    fn run_newest(&mut self) -> Result<()> {
        let step = SeqStep {
            kv: &mut *self.kv,
            tokens: &[0],
            want: Want::Nothing,
        };
        self.model.step(&mut [step], Ids::OnDevice)?;
        self.newest = Some(self.model.choose_on_device(0)?);
        Ok(())
    }
}

impl<B: Backend> Drop for GreedyDecode<'_, B> {
    /// Waits for the dropped step (its token lands in memory the backend reuses) and gives back
    /// the page it may have taken.
    fn drop(&mut self) {
        if let Some(newest) = self.newest.take() {
            // An error here would have been the step's; the caller has already stopped.
            let _ = self.model.backend.wait_argmax(newest);
        }
        let len = self.kv.len();
        self.model.pages.truncate(self.kv, len);
    }
}

impl<B: Backend> Llama<B> {
    /// The most likely next token after row `row` of the last step, left where the next step
    /// reads its input, and on its way to the host.
    fn choose_on_device(&mut self, row: usize) -> Result<B::PendingArgmax> {
        self.lm_head(row, 1)?;
        self.backend
            .queue_argmax(self.scratch.logits, self.inputs.ids(), self.config.vocab_size)
    }
}
