//! Continuous batching: many requests share one model, each step running the next token of
//! every decoding sequence together with chunks of waiting prompts.
//!
//! A [`Scheduler`] owns the model and runs on one thread; an [`EngineHandle`] (cheap to clone,
//! usable from any thread) submits requests, each with an [`EventSink`] that receives its tokens
//! as they come. Per step: sequences whose listener has gone are dropped and their pages freed;
//! waiting requests are admitted first come, first served while there is room (their prompt
//! reusing any cached prefix); every running sequence contributes its next token, and prompts
//! fill the rest of the step's token budget in chunks, so a long prompt never stalls the streams.
//! The budget depends on the load: with no sequence decoding, a prompt takes steps as large as
//! the model runs (`max_batch`, which prefills fastest); while sequences decode, a step holds at
//! most `SchedulerConfig::decode_batch_tokens`, which bounds their inter-token gap.
//! When the KV cache runs out of pages, the newest sequence is preempted: its pages are freed
//! and it goes back to the front of the queue, to be recomputed when there is room again.
//! A constrained sequence's mask for its next token is computed on a thread of its own while
//! the model runs the step, and applied to its logits before sampling (for greedy sequences, on
//! the device, to its argmax).

use super::constraint::{Constraint, ConstraintError, ConstraintSpec, Grammars, TokenMask};
use super::output::{OutputLimits, OutputState, StopReason};
use super::sampler::{Sampler, SamplerConfig};
use crate::backend::Backend;
use crate::model::{KvCache, Llama, PagePool, PageUsage, SeqStep, StepOutput, StepSink, Want};
use crate::tokenizer::Tokenizer;
use crate::Result;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One completion to run.
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplerConfig,
    pub max_tokens: usize,
    /// Generation stops before the first of these in the text.
    pub stop: Vec<String>,
    /// Generation stops at any of these tokens, which are left out of the text.
    pub stop_token_ids: Vec<u32>,
    /// What the output must match; checked at submission.
    pub constraint: Option<ConstraintSpec>,
    /// Log-probabilities of each chosen token and this many alternatives; none if `None`.
    pub logprobs: Option<usize>,
    /// Keep going through end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    pub sink: Box<dyn EventSink>,
}

/// Where a request's events go.
pub trait EventSink: Send {
    /// Delivers an event; false once nobody listens (the request is then cancelled).
    fn send(&mut self, event: Event) -> bool;
    /// Whether the listener has gone (checked every step, so a cancelled request frees its
    /// pages without waiting for its next token).
    fn is_closed(&self) -> bool {
        false
    }
}

impl EventSink for Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        Sender::send(self, event).is_ok()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Done(Completion),
    /// The request failed; no more events follow.
    Error(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Text that became certain with this token: possibly empty (a character or a possible
    /// stop string still incomplete), possibly more than the token's own.
    pub text: String,
    pub logprob: Option<TokenLogprob>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl From<StopReason> for FinishReason {
    fn from(reason: StopReason) -> Self {
        match reason {
            // A sequence is never cancelled by its output; a cancelled request ends without a
            // completion.
            StopReason::EndOfGeneration
            | StopReason::StopString
            | StopReason::StopToken
            | StopReason::ConstraintComplete
            | StopReason::Cancelled => FinishReason::Stop,
            StopReason::MaxTokens | StopReason::ContextFull => FinishReason::Length,
        }
    }
}

impl FinishReason {
    /// The name OpenAI's API gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt of {prompt} tokens plus {max_tokens} to generate exceeds the context of {context} tokens")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("token id {token} in {field} is outside the vocabulary of {vocab}")]
    OutOfVocabulary {
        /// The [`Request`] field.
        field: &'static str,
        token: u32,
        vocab: usize,
    },
    #[error("invalid constraint: {0}")]
    Constraint(ConstraintError),
    #[error("the queue is full ({0} requests waiting)")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Observations for monitoring; every method defaults to doing nothing.
pub trait Metrics: Send + Sync {
    fn request_finished(&self, _completion: &Completion) {}
    fn request_cancelled(&self) {}
    fn time_to_first_token(&self, _seconds: f64) {}
    fn inter_token_latency(&self, _seconds: f64) {}
    fn preempted(&self) {}
    /// A step was planned: `decode_tokens` sequences' next tokens and `prompt_tokens` of prompts.
    fn step_planned(&self, _decode_tokens: usize, _prompt_tokens: usize) {}
}

struct NoMetrics;
impl Metrics for NoMetrics {}

/// What the engine is doing, as of its last step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStatus {
    pub queued: usize,
    pub running: usize,
    pub pages: PageUsage,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Requests that may wait for admission before new ones are refused.
    pub max_queue: usize,
    /// Most tokens (prompt and generated) per sequence; the model's context and the KV pool
    /// bound it too.
    pub max_context: usize,
    /// Most tokens a step runs while any sequence is decoding (their next tokens, then prompt
    /// chunks in what is left): a step's time is the running streams' inter-token gap. Every
    /// decoding sequence gets its token regardless. With none decoding, a step runs up to the
    /// model's `max_batch`; this never raises that.
    pub decode_batch_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_queue: 256,
            max_context: usize::MAX,
            decode_batch_tokens: usize::MAX,
        }
    }
}

struct Shared {
    /// Submitted and not yet admitted.
    queued: AtomicUsize,
    shutting_down: AtomicBool,
    status: Mutex<EngineStatus>,
}

/// A request as it reaches the scheduler: with its constraint compiled.
struct Submitted {
    request: Request,
    constraint: Option<Constraint>,
}

/// Submits requests to a running [`Scheduler`].
#[derive(Clone)]
pub struct EngineHandle {
    requests: Sender<Submitted>,
    shared: Arc<Shared>,
    max_queue: usize,
    context: usize,
    tokenizer: Arc<Tokenizer>,
    /// Built for the first constrained request (it indexes the whole vocabulary).
    grammars: Arc<OnceLock<std::result::Result<Grammars, String>>>,
}

impl EngineHandle {
    pub fn submit(&self, request: Request) -> std::result::Result<(), SubmitError> {
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if request.prompt.len() + request.max_tokens.max(1) > self.context {
            return Err(SubmitError::TooLong {
                prompt: request.prompt.len(),
                max_tokens: request.max_tokens,
                context: self.context,
            });
        }
        let vocab = self.tokenizer.vocab_size();
        let biased = request
            .sampling
            .logit_bias
            .iter()
            .map(|&(token, _)| ("logit_bias", token));
        let stopping = request.stop_token_ids.iter().map(|&token| ("stop_token_ids", token));
        if let Some((field, token)) = biased.chain(stopping).find(|&(_, token)| token as usize >= vocab) {
            return Err(SubmitError::OutOfVocabulary { field, token, vocab });
        }
        // Compiled here, on the caller's thread, so that a bad one is refused at once and a
        // large one never holds up the running streams.
        let constraint = match &request.constraint {
            Some(spec) => Some(self.compile(spec).map_err(SubmitError::Constraint)?),
            None => None,
        };
        let queued = self.shared.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= self.max_queue {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(queued));
        }
        self.requests.send(Submitted { request, constraint }).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::ShuttingDown
        })
    }

    /// Starts building what every constraint compiles against (the tokenizer's token trie: a
    /// quarter of a second for a 128k vocabulary) on a thread of its own, so that the first
    /// constrained request after a server starts does not wait for it.
    pub fn prepare_constraints(&self) {
        let handle = self.clone();
        std::thread::spawn(move || {
            handle.grammars();
        });
    }

    fn grammars(&self) -> &std::result::Result<Grammars, String> {
        self.grammars
            .get_or_init(|| Grammars::new(&self.tokenizer).map_err(|e| e.to_string()))
    }

    fn compile(&self, spec: &ConstraintSpec) -> std::result::Result<Constraint, ConstraintError> {
        match self.grammars() {
            Ok(grammars) => grammars.compile(spec),
            Err(e) => Err(ConstraintError(format!(
                "constraints are unavailable with this tokenizer: {e}"
            ))),
        }
    }

    /// Requests that may wait for admission at once.
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// The most tokens (prompt and generated) one sequence may hold.
    pub fn context(&self) -> usize {
        self.context
    }

    pub fn status(&self) -> EngineStatus {
        *self.shared.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses new requests from now on; the scheduler finishes the ones it has, then returns.
    pub fn shut_down(&self) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
    }
}

/// A request being served.
struct Sequence {
    request: Request,
    /// The prompt, then every token generated so far; the last one may not have run yet.
    tokens: Vec<u32>,
    kv: KvCache,
    sampler: Sampler,
    output: OutputState,
    /// Taken out while its next mask is being computed.
    constraint: Option<Constraint>,
    cached_tokens: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    finished: Option<FinishReason>,
    /// Its listener has gone.
    cancelled: bool,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.request.prompt.len()
    }

    /// Tokens known but not yet run through the model.
    fn pending(&self) -> usize {
        self.tokens.len() - self.kv.len()
    }

    fn send(&mut self, event: Event) {
        if !self.request.sink.send(event) {
            self.cancelled = true;
        }
    }

    /// Puts its constraint back from the task that computed its mask; returns the mask.
    fn take_back(&mut self, masking: Receiver<MaskResult>) -> std::result::Result<TokenMask, ConstraintError> {
        match masking.recv() {
            Ok((constraint, mask)) => {
                self.constraint = Some(constraint);
                mask
            }
            Err(_) => Err(ConstraintError("the constraint's mask computation panicked".into())),
        }
    }

    /// Ends the request with an error.
    fn fail(&mut self, message: String) {
        self.send(Event::Error(message));
        self.cancelled = true;
    }
}

pub struct Scheduler<B: Backend> {
    model: Llama<B>,
    /// The model's KV pages: the scheduler gives each sequence its own, and shares cached prefixes.
    pages: PagePool,
    tokenizer: Arc<Tokenizer>,
    requests: Receiver<Submitted>,
    shared: Arc<Shared>,
    metrics: Arc<dyn Metrics>,
    waiting: VecDeque<Sequence>,
    /// In admission order: the last is the newest, the first to be preempted.
    running: Vec<Sequence>,
    /// Tokens per sequence.
    context: usize,
    /// `SchedulerConfig::decode_batch_tokens`.
    decode_batch_tokens: usize,
}

impl<B: Backend> Scheduler<B> {
    pub fn new(
        model: Llama<B>,
        pages: PagePool,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
    ) -> (Scheduler<B>, EngineHandle) {
        let (tx, rx) = channel();
        let context = model.new_kv_cache(config.max_context).capacity();
        let shared = Arc::new(Shared {
            queued: AtomicUsize::new(0),
            shutting_down: AtomicBool::new(false),
            status: Mutex::new(EngineStatus {
                pages: pages.usage(),
                ..EngineStatus::default()
            }),
        });
        let handle = EngineHandle {
            requests: tx,
            shared: shared.clone(),
            max_queue: config.max_queue,
            context,
            tokenizer: tokenizer.clone(),
            grammars: Arc::new(OnceLock::new()),
        };
        let scheduler = Scheduler {
            model,
            pages,
            tokenizer,
            requests: rx,
            shared,
            metrics: Arc::new(NoMetrics),
            waiting: VecDeque::new(),
            running: Vec::new(),
            context,
            decode_batch_tokens: config.decode_batch_tokens,
        };
        (scheduler, handle)
    }

    pub fn with_metrics(mut self, metrics: Arc<dyn Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    /// Serves requests until the handle is shut down (or every handle dropped) and all
    /// accepted work is done. A failing step fails the requests in it; the loop goes on.
    pub fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.shared.shutting_down.load(Ordering::SeqCst) && self.shared.queued.load(Ordering::SeqCst) == 0 {
                    break;
                }
                match self.requests.recv_timeout(Duration::from_millis(50)) {
                    Ok(request) => self.enqueue(request),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            if let Err(e) = self.step() {
                tracing::error!("step failed: {e}");
                for mut seq in self.running.drain(..) {
                    seq.send(Event::Error(e.to_string()));
                    self.pages.free(&mut seq.kv);
                }
                self.publish_status();
            }
        }
    }

    fn enqueue(&mut self, Submitted { request, constraint }: Submitted) {
        let sampler = Sampler::new(request.sampling.clone());
        let kv = self.model.new_kv_cache(self.context);
        let limits = OutputLimits {
            max_tokens: request.max_tokens,
            // Every token, the last included, fits in the sequence: `submit` holds the prompt
            // and `max_tokens` to the context.
            context_room: kv.capacity().saturating_sub(request.prompt.len()),
            ignore_eos: request.ignore_eos,
        };
        let output = OutputState::new(request.stop.clone(), request.stop_token_ids.clone(), limits);
        self.waiting.push_back(Sequence {
            tokens: request.prompt.clone(),
            kv,
            sampler,
            output,
            constraint,
            cached_tokens: 0,
            arrived: Instant::now(),
            last_token: None,
            finished: None,
            cancelled: false,
            request,
        });
    }

    /// Takes new requests, admits, runs one batched step and delivers its tokens. Returns
    /// whether there was anything to run.
    pub fn step(&mut self) -> Result<bool> {
        while let Ok(request) = self.requests.try_recv() {
            self.enqueue(request);
        }
        self.drop_cancelled();
        self.admit();
        let batch = self.plan();
        if batch.is_empty() {
            // Only possible when a lone sequence outgrows the whole cache.
            for mut seq in self.running.drain(..) {
                seq.send(Event::Error("the KV cache cannot hold this sequence".into()));
                self.pages.free(&mut seq.kv);
            }
            self.publish_status();
            return Ok(false);
        }
        let mut kvs: Vec<KvCache> = batch
            .iter()
            .map(|&(i, _)| std::mem::take(&mut self.running[i].kv))
            .collect();
        let inputs: Vec<Vec<u32>> = batch
            .iter()
            .zip(&kvs)
            .map(|(&(i, n), kv)| self.running[i].tokens[kv.len()..kv.len() + n].to_vec())
            .collect();
        let mut steps: Vec<SeqStep> = kvs
            .iter_mut()
            .zip(&inputs)
            .zip(&batch)
            .map(|((kv, tokens), &(i, _))| {
                let seq = &self.running[i];
                let greedy = seq.request.logprobs.is_none() && seq.request.sampling.is_plain_greedy();
                let want = if kv.len() + tokens.len() < seq.tokens.len() {
                    Want::Nothing
                } else if greedy && seq.constraint.is_some() {
                    Want::ConstrainedArgmax
                } else if greedy {
                    Want::Argmax
                } else {
                    Want::Logits
                };
                SeqStep { kv, tokens, want }
            })
            .collect();
        // The constraints of the sequences that get a token this step, out for their masks.
        let constraints: Vec<Option<Constraint>> = steps
            .iter()
            .zip(&batch)
            .map(|(step, &(i, _))| match step.want {
                Want::Nothing => None,
                _ => self.running[i].constraint.take(),
            })
            .collect();
        // On rayon's pool, whose threads outlive the step: a thread spawned per constrained
        // sequence and step cost more host time than the masks themselves at 32 streams.
        let masking = constraints
            .into_iter()
            .map(|c| {
                c.map(|mut constraint| {
                    let (sender, receiver) = sync_channel(1);
                    rayon::spawn(move || {
                        // A panic on rayon's pool would abort the process: caught, it drops the
                        // sender instead, and the step fails this sequence alone (`take_back`).
                        let masked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                            let mask = constraint.mask();
                            (constraint, mask)
                        }));
                        if let Ok(masked) = masked {
                            // The step keeps the receiver until it takes the mask.
                            let _ = sender.send(masked);
                        }
                    });
                    receiver
                })
            })
            .collect();
        let mut outputs = StepOutputs {
            running: &mut self.running,
            batch: &batch,
            masking,
            masks: (0..batch.len()).map(|_| None).collect(),
            tokenizer: &self.tokenizer,
            metrics: self.metrics.as_ref(),
        };
        let result = self.model.forward_batch(&mut steps, &mut outputs);
        // A failed step leaves masks unused: their constraints go back all the same.
        for j in 0..batch.len() {
            if let Some(Err(e)) = outputs.mask(j) {
                tracing::error!("{e}");
            }
        }
        drop(steps);
        for (kv, &(i, _)) in kvs.into_iter().zip(&batch) {
            self.running[i].kv = kv;
        }
        result?;
        for &(i, _) in &batch {
            self.pages.after_step(&mut self.running[i].kv);
        }
        self.retire_finished();
        self.publish_status();
        Ok(true)
    }

    fn drop_cancelled(&mut self) {
        let closed = |s: &Sequence| s.cancelled || s.request.sink.is_closed();
        if !self.waiting.iter().chain(&self.running).any(closed) {
            return;
        }
        let (gone_waiting, waiting): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|s| closed(s));
        self.waiting = waiting.into();
        self.shared.queued.fetch_sub(gone_waiting.len(), Ordering::SeqCst);
        let (gone_running, running): (Vec<_>, Vec<_>) = self.running.drain(..).partition(|s| closed(s));
        self.running = running;
        for mut seq in gone_waiting.into_iter().chain(gone_running) {
            self.pages.free(&mut seq.kv);
            self.metrics.request_cancelled();
        }
    }

    /// Admits waiting sequences in order while there are sequence slots and pages for their
    /// known tokens (after reusing what the prefix cache holds).
    fn admit(&mut self) {
        while self.running.len() < self.model.max_seqs() {
            let Some(seq) = self.waiting.front_mut() else { break };
            if seq.kv.is_empty() {
                let reused = self.pages.share_prefix(&mut seq.kv, &seq.tokens);
                if seq.generated() == 0 {
                    seq.cached_tokens = reused;
                }
            }
            let needed = self.pages.pages_needed(&seq.kv, seq.tokens.len() + 1);
            if needed > self.pages.available() {
                // Give the shared pages back until there is room (they stay cached).
                self.pages.truncate(&mut seq.kv, 0);
                break;
            }
            if let Some(seq) = self.waiting.pop_front() {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                self.running.push(seq);
            }
        }
    }

    /// Chooses this step's work: `(running index, tokens)`. Every decoding sequence gets its
    /// next token (preempting the newest sequences while pages are short), then prompts fill
    /// what is left of the token budget. If nothing at all fits, the newest is preempted too.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        loop {
            let needed: usize = self
                .running
                .iter()
                .filter(|s| s.pending() == 1)
                .map(|s| self.pages.pages_needed(&s.kv, s.kv.len() + 1))
                .sum();
            if needed > self.pages.available() && self.running.len() > 1 {
                self.preempt_newest();
                continue;
            }
            let batch = self.fill();
            if !batch.is_empty() || self.running.len() <= 1 {
                return batch;
            }
            self.preempt_newest();
        }
    }

    fn fill(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.model.max_batch();
        let mut batch = Vec::new();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if seq.pending() == 1 && budget > 0 && self.pages.reserve(&mut seq.kv, 1).is_ok() {
                batch.push((i, 1));
                budget -= 1;
            }
        }
        let decoding = batch.len();
        if decoding > 0 {
            budget = budget.min(self.decode_batch_tokens.saturating_sub(decoding));
        }
        for (i, seq) in self.running.iter_mut().enumerate() {
            if seq.pending() > 1 && budget > 0 {
                let n = seq.pending().min(budget).min(self.pages.room(&seq.kv));
                if n > 0 && self.pages.reserve(&mut seq.kv, n).is_ok() {
                    batch.push((i, n));
                    budget -= n;
                }
            }
        }
        if !batch.is_empty() {
            let prompt_tokens = batch[decoding..].iter().map(|&(_, n)| n).sum();
            self.metrics.step_planned(decoding, prompt_tokens);
        }
        batch.sort_unstable();
        batch
    }

    fn preempt_newest(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.pages.truncate(&mut seq.kv, 0);
            self.shared.queued.fetch_add(1, Ordering::SeqCst);
            self.waiting.push_front(seq);
            self.metrics.preempted();
        }
    }

    fn retire_finished(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            if seq.finished.is_none() && !seq.cancelled {
                i += 1;
                continue;
            }
            let mut seq = self.running.remove(i);
            self.pages.free(&mut seq.kv);
            if let Some(finish) = seq.finished {
                let completion = Completion {
                    finish,
                    prompt_tokens: seq.request.prompt.len(),
                    completion_tokens: seq.generated(),
                    cached_tokens: seq.cached_tokens,
                };
                self.metrics.request_finished(&completion);
                seq.send(Event::Done(completion));
            } else {
                self.metrics.request_cancelled();
            }
        }
    }

    fn publish_status(&self) {
        let status = EngineStatus {
            queued: self.shared.queued.load(Ordering::SeqCst),
            running: self.running.len(),
            pages: self.pages.usage(),
        };
        *self.shared.status.lock().unwrap_or_else(|e| e.into_inner()) = status;
    }
}

/// A sequence's constraint back from its thread, with the mask it computed.
type MaskResult = (Constraint, std::result::Result<TokenMask, ConstraintError>);

/// A step's outputs on their way to its sequences (`batch[j]` is step index j's), with the
/// masks being computed for the constrained ones.
struct StepOutputs<'s> {
    running: &'s mut [Sequence],
    batch: &'s [(usize, usize)],
    masking: Vec<Option<Receiver<MaskResult>>>,
    /// Masks already waited for, until their sequence's output comes.
    masks: Vec<Option<std::result::Result<TokenMask, ConstraintError>>>,
    tokenizer: &'s Tokenizer,
    metrics: &'s dyn Metrics,
}

impl StepOutputs<'_> {
    /// Step index j's mask (waiting for it, and putting its constraint back), if it has one.
    fn mask(&mut self, j: usize) -> Option<std::result::Result<TokenMask, ConstraintError>> {
        let seq = &mut self.running[self.batch[j].0];
        self.masks[j]
            .take()
            .or_else(|| self.masking[j].take().map(|handle| seq.take_back(handle)))
    }
}

impl StepSink for StepOutputs<'_> {
    fn allowed(&mut self, j: usize, words: &mut [u32]) {
        let mask = self.mask(j);
        match &mask {
            Some(Ok(mask)) => mask.write_bits(words),
            // The sequence fails with the mask's error when its output comes.
            _ => words.fill(u32::MAX),
        }
        self.masks[j] = mask;
    }

    fn output(&mut self, j: usize, output: StepOutput) {
        let mask = self.mask(j);
        next_token(
            &mut self.running[self.batch[j].0],
            output,
            mask,
            self.tokenizer,
            self.metrics,
        );
    }
}

/// Takes a sequence's next token (sampled from its logits within its constraint's `mask`, or the
/// device's argmax), streams it, and decides whether it is done.
fn next_token(
    seq: &mut Sequence,
    output: StepOutput,
    mask: Option<std::result::Result<TokenMask, ConstraintError>>,
    tokenizer: &Tokenizer,
    metrics: &dyn Metrics,
) {
    let mask = match mask.transpose() {
        Ok(mask) => mask,
        Err(e) => return seq.fail(e.to_string()),
    };
    let (token, logits) = match output {
        // The device's choice within the mask is a token it allows unless it allows none.
        StepOutput::Argmax(id) if mask.as_ref().is_some_and(|mask| !mask.allows(id)) => {
            return seq.fail("the constraint and the logit bias leave no token to sample".into())
        }
        StepOutput::Argmax(id) => (id, None),
        // Every known token has run: the new one takes the next position.
        StepOutput::Logits(logits) => match seq.sampler.sample(logits, &seq.tokens, mask.as_ref(), seq.tokens.len()) {
            Some(token) => (token, Some(logits)),
            None => return seq.fail("the constraint and the logit bias leave no token to sample".into()),
        },
    };
    let now = Instant::now();
    match seq.last_token {
        None => metrics.time_to_first_token((now - seq.arrived).as_secs_f64()),
        Some(last) => metrics.inter_token_latency((now - last).as_secs_f64()),
    }
    seq.last_token = Some(now);
    let mut step = match seq.output.push(tokenizer, token) {
        Ok(step) => step,
        Err(e) => return seq.fail(e.to_string()),
    };
    if step.token_is_output {
        if let Some(constraint) = &mut seq.constraint {
            let complete = match constraint.accept(token) {
                Ok(complete) => complete,
                Err(e) => return seq.fail(e.to_string()),
            };
            if complete {
                if let Err(e) = seq
                    .output
                    .end_with(&mut step, tokenizer, StopReason::ConstraintComplete)
                {
                    return seq.fail(e.to_string());
                }
            }
        }
    }
    seq.finished = step.finished.map(FinishReason::from);
    if !step.token_is_output {
        // The end-of-generation token that ended the sequence: an event only for the text it
        // released.
        if !step.text.is_empty() {
            seq.send(Event::Token(TokenEvent {
                id: token,
                text: step.text,
                logprob: None,
            }));
        }
        return;
    }
    let logprob = match (seq.request.logprobs, logits) {
        (Some(top), Some(logits)) => Some(token_logprob(logits, token, top)),
        _ => None,
    };
    seq.tokens.push(token);
    seq.send(Event::Token(TokenEvent {
        id: token,
        text: step.text,
        logprob,
    }));
}

/// `log softmax(logits)[token]`, and the `top` most likely tokens with theirs.
fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    let lp = |l: f32| l - max - log_sum;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() < top || l > best[best.len() - 1].1 {
                let at = best.partition_point(|&(_, b)| b >= l);
                best.insert(at, (i as u32, l));
                best.truncate(top);
            }
        }
    }
    TokenLogprob {
        logprob: lp(logits[token as usize]),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}
