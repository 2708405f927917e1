//! The Llama forward pass, written once against the [`Backend`] ops.

use super::config::ModelConfig;
use super::kv_cache::{KvCache, PagePool};
use super::weights::{self, FeedForwardWeights, MixtureWeights, RopeTables, TensorSource, Weights};
use crate::backend::{
    AttentionKv, Backend, BlockHandle, ExpertScratch, ExpertSet, FeedForward, FeedForwardScratch, Input, Mixture,
    MixtureScratch, NewRows, NextInput, PagedKv, Projection, Residual, Routes, Routing, SharedExpert, StepLayout,
};
use crate::parallel::{Communicator, Shard};
use crate::{Error, Result};

mod greedy;
mod sharded;
pub use greedy::GreedyDecode;
use sharded::{Group, Work};

/// Which rows of a forward call need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// Only the last token's (generation).
    Last,
    /// Every token from this index of the call on (perplexity).
    From(usize),
}

#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Most tokens one backend step processes; longer inputs are split into steps.
    pub max_batch: usize,
    /// Tokens of KV cache to reserve room for, across all sequences.
    pub kv_tokens: usize,
    /// Most sequences one step may hold.
    pub max_seqs: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_batch: 512,
            kv_tokens: 4096,
            max_seqs: 1,
        }
    }
}

/// Positions per KV cache page.
pub const PAGE_SIZE: usize = 16;

/// Most tokens of KV cache, or of one batch, a model is loaded with: far beyond any context,
/// and small enough that every size computed from them fits in a `usize`.
pub const MAX_LOAD_TOKENS: usize = 1 << 32;

/// Rows of logits computed per LM-head step, so a long scored range never needs a
/// `[tokens, vocab]` buffer at once.
const LOGIT_ROWS_PER_STEP: usize = 32;

/// One sequence's part of a batched step: `tokens` run after those `kv` holds.
pub struct SeqStep<'a> {
    pub kv: &'a mut KvCache,
    pub tokens: &'a [u32],
    /// What it wants from its last token.
    pub want: Want,
}

/// What a sequence wants from the last token of its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    Nothing,
    Logits,
    /// Only the most likely next token (greedy decoding): the logits stay on the device.
    Argmax,
    /// The most likely of the tokens its constraint allows (constrained greedy decoding), which
    /// the step asks its [`StepSink::allowed`] for; the logits stay on the device.
    ConstrainedArgmax,
}

/// Where a batched step's outputs go, by the index of the sequence in the step.
pub trait StepSink {
    /// Writes the tokens sequence `owner` may take next into `words` (token i is bit i % 32 of
    /// word i / 32); asked once a step, before its output, for a `Want::ConstrainedArgmax`.
    fn allowed(&mut self, owner: usize, words: &mut [u32]);
    /// Takes sequence `owner`'s output.
    fn output(&mut self, owner: usize, output: StepOutput);
}

/// `Llama::forward`'s outputs: the logits of the rows asked for, every token allowed.
struct LogitsSink<F>(F);

impl<F: FnMut(usize, &[f32])> StepSink for LogitsSink<F> {
    fn allowed(&mut self, _: usize, words: &mut [u32]) {
        words.fill(u32::MAX);
    }

    fn output(&mut self, row: usize, output: StepOutput) {
        if let StepOutput::Logits(logits) = output {
            (self.0)(row, logits)
        }
    }
}

/// What a step gives a sequence that wanted something.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutput<'a> {
    Logits(&'a [f32]),
    Argmax(u32),
}

/// A row of the last step whose output someone wants, and whom to give it to.
#[derive(Clone, Copy, PartialEq, Eq)]
struct OutputRow {
    row: usize,
    want: Want,
    owner: usize,
}

/// The paged KV cache in backend memory: per layer, K and V of every page.
struct PagedCache {
    k: Vec<BlockHandle>,
    v: Vec<BlockHandle>,
    /// Page ids per sequence row of a step.
    table_width: usize,
}

/// Where a step's token ids come from, and what it does after its layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepKind {
    /// Ids from the host; the caller asks for outputs after.
    Host,
    /// A step of greedy decoding ([`GreedyDecode`]): one sequence, one token, left in the step
    /// inputs by the step before with its position (its `kv` does not hold it yet). The step then
    /// chooses the next token and leaves it there in turn, and in `choices[slot]` for the host:
    /// the whole step, head and argmax included, is one recording, and the host sends inputs only
    /// when the sequence takes a new page, so no step waits on a copy from the host.
    Greedy { slot: usize },
}

/// A step's inputs, all u32, packed in one block so they travel to the device in one copy:
/// token ids, positions and sequence rows (`max_batch` each), then the block tables.
struct StepInputs {
    block: BlockHandle,
    /// What the block holds past the ids: as last sent, with the positions greedy choices
    /// advanced since ([`Llama::chosen`]). Empty where that is not known.
    sent: Vec<u32>,
    /// The next step's inputs, as packed.
    packed: Vec<u32>,
    max_batch: usize,
}

impl StepInputs {
    fn field(&self, i: usize) -> BlockHandle {
        self.block.slice(i * self.max_batch * 4, self.max_batch * 4)
    }
    fn ids(&self) -> BlockHandle {
        self.field(0)
    }
    fn positions(&self) -> BlockHandle {
        self.field(1)
    }
    fn token_seqs(&self) -> BlockHandle {
        self.field(2)
    }
    fn tables(&self) -> BlockHandle {
        let start = 3 * self.max_batch * 4;
        self.block.slice(start, self.block.len - start)
    }
    /// The positions and sequence rows of the first `n` tokens, as last sent (`write_inputs`
    /// leaves them in `sent`).
    fn layout(&self, n: usize) -> Result<StepLayout<'_>> {
        let field = |i: usize| {
            self.sent
                .get(i * self.max_batch..i * self.max_batch + n)
                .ok_or_else(|| Error::Backend(format!("the inputs of a step of {n} tokens were not sent")))
        };
        Ok(StepLayout {
            positions: field(1)?,
            token_seqs: field(2)?,
        })
    }
}

/// Per-step activation buffers, sized for `max_batch` tokens.
struct Scratch {
    x: BlockHandle,
    normed: BlockHandle,
    q: BlockHandle,
    k: BlockHandle,
    v: BlockHandle,
    attn: BlockHandle,
    proj: BlockHandle,
    gate: BlockHandle,
    up: BlockHandle,
    hidden: BlockHandle,
    q_normed: BlockHandle,
    k_normed: BlockHandle,
    logits: BlockHandle,
    /// A sharded model's rows of its own vocabulary's logits, before they are gathered into
    /// `logits` (empty on one rank).
    logits_part: BlockHandle,
    /// Constrained rows' allowed tokens, as bits (see `StepSink::allowed`).
    allowed: BlockHandle,
    /// Device argmax of each row of `logits`.
    argmax: BlockHandle,
    /// The mixture-of-experts blocks' (empty without experts), `mixture_widths` order.
    router_logits: BlockHandle,
    route_ids: BlockHandle,
    route_weights: BlockHandle,
    expert_rows: BlockHandle,
    expert_gate: BlockHandle,
    expert_up: BlockHandle,
    expert_hidden: BlockHandle,
    expert_out: BlockHandle,
    expert_groups: BlockHandle,
    shared_gates: BlockHandle,
}

impl Scratch {
    fn feed_forward(&self) -> FeedForwardScratch {
        FeedForwardScratch {
            gate: self.gate,
            up: self.up,
            hidden: self.hidden,
            proj: self.proj,
        }
    }

    /// A mixture block's scratch, for `k` experts a token; the shared expert takes the dense
    /// feed-forward rows.
    fn mixture(&self, k: usize) -> MixtureScratch {
        MixtureScratch {
            logits: self.router_logits,
            routes: Routes {
                ids: self.route_ids,
                weights: self.route_weights,
                k,
            },
            experts: ExpertScratch {
                rows: self.expert_rows,
                gate: self.expert_gate,
                up: self.expert_up,
                hidden: self.expert_hidden,
                out: self.expert_out,
                groups: self.expert_groups,
            },
            shared: self.feed_forward(),
            shared_gates: self.shared_gates,
        }
    }
}

pub struct Llama<B: Backend> {
    pub config: ModelConfig,
    /// The shape this rank computes: `config` with its share of the heads and feed-forward
    /// columns (all of them on one rank).
    local: ModelConfig,
    /// Its tensor-parallel group, where the model is split across ranks.
    group: Option<Group<B>>,
    pub backend: B,
    weights: Weights<B::Weight>,
    /// The rope kernels' tables of per-pair frequencies.
    freqs: RopeTables,
    scratch: Scratch,
    inputs: StepInputs,
    cache: PagedCache,
    max_batch: usize,
    max_seqs: usize,
    /// Host copies of a few rows of logits; after `forward_last`, the first row is the last token's.
    logits: B::HostF32,
    /// The allowed tokens of a run of constrained rows, on their way to `scratch.allowed`.
    allowed: Vec<u32>,
    /// Recorded steps (graph handles), by their number of tokens and kind.
    graphs: Vec<((usize, StepKind), usize)>,
    /// Where greedy steps leave their choices, used in turn, so that the host reads one while
    /// the step after writes the other.
    choices: [B::ChoiceSlot; 2],
    /// The rows wanted from the current step (reused: the decode loop allocates nothing).
    output_rows: Vec<OutputRow>,
}

impl<B: Backend> Llama<B> {
    /// Loads the weights `config` calls for from `source` onto `backend`, reserving the arena
    /// for them, the activations of `options.max_batch` tokens and `options.kv_tokens` of cache;
    /// with the pool of that cache's pages, for the engine to hand out.
    pub fn load<S: TensorSource + ?Sized>(
        source: &S,
        config: ModelConfig,
        backend: B,
        options: LoadOptions,
    ) -> Result<(Llama<B>, PagePool)> {
        let shard = Shard::whole(&config);
        Self::load_shard(source, config, &shard, None, backend, options)
    }

    /// `load` of `shard`'s share of the model, a rank of the group `comm` joins it to.
    fn load_shard<S: TensorSource + ?Sized>(
        source: &S,
        config: ModelConfig,
        shard: &Shard,
        comm: Option<Box<dyn Communicator<B>>>,
        mut backend: B,
        options: LoadOptions,
    ) -> Result<(Llama<B>, PagePool)> {
        let local = shard.config(&config);
        // A rank of a group (even of one) gathers its rows of the LM head's logits.
        let head_rows = match comm {
            None => 0,
            Some(_) => shard.vocab.len(),
        };
        for (what, tokens) in [("KV cache", options.kv_tokens), ("batch", options.max_batch)] {
            if tokens > MAX_LOAD_TOKENS {
                return Err(Error::InvalidArgument(format!(
                    "a {what} of {tokens} tokens is more than the {MAX_LOAD_TOKENS} a model can be loaded with"
                )));
            }
        }
        let max_batch = options.max_batch.max(1);
        let max_seqs = options.max_seqs.clamp(1, max_batch);
        let n_pages = options.kv_tokens.max(1).div_ceil(PAGE_SIZE);
        // A sequence holds at most the pool, unless every layer slides: then it holds one window.
        let longest = match config.window_of_every_layer() {
            Some(_) => config.context_length,
            None => config.context_length.min(n_pages * PAGE_SIZE),
        };
        let table_width = longest.div_ceil(PAGE_SIZE);
        let page_bytes = PAGE_SIZE * local.attention().kv_width() * backend.kv_type().bytes();
        let inputs_len = 3 * max_batch + max_seqs * table_width;
        let (largest_weight, max_n_in) = weights::largest(&config);
        let steps = max_batch.max(LOGIT_ROWS_PER_STEP);
        // A stacked expert tensor is one matrix per expert.
        let matrices: Vec<usize> = source
            .all()
            .into_iter()
            .flat_map(|(_, dims, b)| match dims[..] {
                [_, _] => vec![b],
                [_, _, experts] => vec![b / experts.max(1); experts],
                _ => Vec::new(),
            })
            .collect();
        let arena = weights::vector_bytes(&local)
            + scratch_bytes(&local, max_batch, head_rows)
            + 2 * config.n_layers * (n_pages * page_bytes).next_multiple_of(256)
            + inputs_len * 4
            + backend.weight_bytes(&matrices)
            + backend.staging_bytes(largest_weight, steps, max_n_in)
            + 64 * 256;
        backend.reserve(arena)?;
        let longest_sequence = config.context_length.min(n_pages * PAGE_SIZE);
        let (weights, freqs) = weights::load(source, &config, shard, &mut backend, longest_sequence)?;
        let scratch = Scratch::new(&mut backend, &local, max_batch, head_rows)?;
        let mut cache = PagedCache {
            k: Vec::with_capacity(config.n_layers),
            v: Vec::with_capacity(config.n_layers),
            table_width,
        };
        for _ in 0..config.n_layers {
            cache.k.push(backend.alloc(n_pages * page_bytes)?);
            cache.v.push(backend.alloc(n_pages * page_bytes)?);
        }
        let inputs = StepInputs {
            block: backend.alloc(inputs_len * 4)?,
            sent: Vec::with_capacity(inputs_len),
            packed: Vec::with_capacity(inputs_len),
            max_batch,
        };
        backend.prepare(steps, max_n_in)?;
        let logits = backend.host_f32(config.vocab_size * LOGIT_ROWS_PER_STEP)?;
        let allowed = vec![0; LOGIT_ROWS_PER_STEP * config.vocab_size.div_ceil(32)];
        let choices = [backend.choice_slot()?, backend.choice_slot()?];
        let model = Llama {
            config,
            local,
            group: comm.map(|comm| Group::new(comm, shard.vocab_widths.clone())),
            backend,
            weights,
            freqs,
            scratch,
            inputs,
            cache,
            max_batch,
            max_seqs,
            allowed,
            logits,
            graphs: Vec::new(),
            choices,
            output_rows: Vec::new(),
        };
        let window = model.config.window_of_every_layer();
        Ok((model, PagePool::new(n_pages, PAGE_SIZE).with_window(window)))
    }

    /// An empty KV cache for a sequence of up to `capacity` tokens (bounded by the context and
    /// the pool). The engine gives it its pages ([`PagePool::reserve`]) and takes them back
    /// ([`PagePool::free`]).
    pub fn new_kv_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(capacity.min(self.cache.table_width * PAGE_SIZE))
    }

    /// Most tokens one step runs.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Most sequences one step runs.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// Ranks the model is split over (1 where it is not).
    pub fn ranks(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.comm.size())
    }

    /// Runs `tokens` after the ones already in `kv`, appending theirs; `kv` holds the pages for
    /// them ([`PagePool::reserve`]). For each row that `rows` asks for, calls
    /// `sink(row index within tokens, logits)`.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        kv: &mut KvCache,
        rows: LogitRows,
        sink: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        if kv.len() + tokens.len() > kv.capacity() {
            return Err(Error::ContextOverflow {
                prompt: kv.len() + tokens.len(),
                generate: 0,
                context: kv.capacity(),
            });
        }
        let mut sink = LogitsSink(sink);
        let first_scored = match rows {
            LogitRows::None => tokens.len(),
            LogitRows::Last => tokens.len().saturating_sub(1),
            LogitRows::From(i) => i,
        };
        for (step, chunk) in tokens.chunks(self.max_batch).enumerate() {
            let offset = step * self.max_batch;
            let from = first_scored.saturating_sub(offset).min(chunk.len());
            self.step(
                &mut [SeqStep {
                    kv: &mut *kv,
                    tokens: chunk,
                    want: Want::Nothing,
                }],
                StepKind::Host,
            )?;
            self.output_rows.clear();
            self.output_rows.extend((from..chunk.len()).map(|row| OutputRow {
                row,
                want: Want::Logits,
                owner: offset + row,
            }));
            self.outputs_for(&mut sink)?;
        }
        Ok(())
    }

    /// Runs one step of several sequences together (at most `max_batch` tokens and `max_seqs`
    /// sequences in all), then gives `sink` the output of each one that wants one.
    pub fn forward_batch(&mut self, steps: &mut [SeqStep], sink: &mut impl StepSink) -> Result<()> {
        self.step(steps, StepKind::Host)?;
        self.output_rows.clear();
        let mut end = 0;
        for (owner, s) in steps.iter().enumerate() {
            end += s.tokens.len();
            if s.want != Want::Nothing {
                self.output_rows.push(OutputRow {
                    row: end - 1,
                    want: s.want,
                    owner,
                });
            }
        }
        self.outputs_for(sink)
    }

    /// For generation: runs `tokens` and returns the logits of the last one (also kept for
    /// [`Llama::last_logits`] until the next forward call).
    pub fn forward_last(&mut self, tokens: &[u32], kv: &mut KvCache) -> Result<&[f32]> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens to run".into()));
        }
        self.forward(tokens, kv, LogitRows::Last, |_, _| {})?;
        Ok(self.last_logits())
    }

    pub fn last_logits(&self) -> &[f32] {
        &self.logits[..self.config.vocab_size]
    }

    /// One batch through every layer; leaves the final hidden states in `scratch.x` (and, for a
    /// greedy step, its choice). A step of a few tokens is recorded as a graph the first time
    /// (where the backend has graphs) and replayed after: it reads everything that changes from
    /// the step inputs, so one recording serves every step of that many tokens and that kind.
    fn step(&mut self, steps: &mut [SeqStep], kind: StepKind) -> Result<()> {
        let n: usize = steps.iter().map(|s| s.tokens.len()).sum();
        if n == 0 || n > self.max_batch || steps.len() > self.max_seqs {
            return Err(Error::InvalidArgument(format!(
                "a step of {n} tokens in {} sequences (at most {} tokens in {} sequences)",
                steps.len(),
                self.max_batch,
                self.max_seqs
            )));
        }
        for s in steps.iter_mut() {
            let len = s.kv.len() + s.tokens.len();
            if len > s.kv.capacity() {
                return Err(Error::ContextOverflow {
                    prompt: len,
                    generate: 0,
                    context: s.kv.capacity(),
                });
            }
            let held = s.kv.pages.len() * PAGE_SIZE;
            if len > held {
                return Err(Error::InvalidArgument(format!(
                    "a step to {len} tokens over pages for {held}: the engine reserves a sequence's pages first"
                )));
            }
        }
        self.pack_inputs(steps);
        self.share(|model| Work::Step {
            packed: model.inputs.packed.clone(),
            n,
            kind,
        })?;
        let ran = self.run_packed(n, kind);
        self.stop_on_error(ran)?;
        if kind == StepKind::Host {
            for s in steps.iter_mut() {
                s.kv.push_tokens(s.tokens);
            }
        }
        Ok(())
    }

    /// A step of `n` tokens whose inputs are packed: sends them, runs the layers (and, for a
    /// greedy step, the choice, which it then marks). Every rank runs it alike.
    fn run_packed(&mut self, n: usize, kind: StepKind) -> Result<()> {
        self.send_inputs(kind)?;
        let plan = self.backend.plan_step(self.inputs.layout(n)?, self.local.attention())?;
        let run = |model: &Self| match kind {
            StepKind::Host => model.layers(n, &plan),
            StepKind::Greedy { slot } => model.layers(n, &plan).and_then(|_| model.choose(0, slot)),
        };
        // A collective that meets on the host waits for its copies, which a recording cannot:
        // such a group (tests, or one GPU's shards) runs its steps op by op rather than in pieces
        // recorded between its two collectives a layer, since it is not where speed is sought.
        let recordable = self.group.as_ref().is_none_or(|g| g.comm.recordable());
        if let Some(&(_, graph)) = self.graphs.iter().find(|(k, _)| *k == (n, kind)) {
            self.backend.replay(graph)?;
        } else if recordable && self.backend.begin_capture(n)? {
            let recorded = run(self);
            let graph = self.backend.end_capture()?;
            recorded?;
            self.graphs.push(((n, kind), graph));
            self.backend.replay(graph)?;
        } else {
            run(self)?;
        }
        match kind {
            StepKind::Host => Ok(()),
            StepKind::Greedy { slot } => self.chosen(0, slot),
        }
    }

    /// `choose(row, slot)`, then `chosen`: on every rank, a greedy choice after a step run
    /// otherwise.
    fn choose_after(&mut self, row: usize, slot: usize) -> Result<()> {
        self.share(|_| Work::Choose { row, slot })?;
        let chosen = self.choose(row, slot).and_then(|_| self.chosen(row, slot));
        self.stop_on_error(chosen)
    }

    /// The most likely token after row `row` of the last step, left where the next step reads
    /// its input (its id, and as its position the one after the row's) and in `choices[slot]`;
    /// `chosen` follows it on the host.
    fn choose(&self, row: usize, slot: usize) -> Result<()> {
        self.lm_head(row, 1)?;
        let positions = self.inputs.positions();
        let next = NextInput {
            token: self.inputs.ids().slice(0, 4),
            chosen_at: positions.slice(row * 4, 4),
            position: positions.slice(0, 4),
        };
        let (logits, vocab) = (self.scratch.logits, self.config.vocab_size);
        self.backend.queue_argmax(logits, next, vocab, &self.choices[slot])
    }

    /// After `choose(row, slot)` is submitted: marks it for the host, and notes the position it
    /// leaves in the step inputs.
    fn chosen(&mut self, row: usize, slot: usize) -> Result<()> {
        let inputs = &mut self.inputs;
        match inputs.sent.get(inputs.max_batch + row).copied() {
            Some(p) => inputs.sent[inputs.max_batch] = p + 1,
            None => inputs.sent.clear(),
        }
        self.backend.mark_choice(&self.choices[slot])
    }

    /// Packs the step's ids, positions, sequence rows and block tables, for `send_inputs`.
    fn pack_inputs(&mut self, steps: &[SeqStep]) {
        let (batch, width) = (self.max_batch, self.cache.table_width);
        let host = &mut self.inputs.packed;
        host.clear();
        host.extend(steps.iter().flat_map(|s| s.tokens));
        host.resize(batch, 0);
        host.extend(
            steps
                .iter()
                .flat_map(|s| (s.kv.len()..s.kv.len() + s.tokens.len()).map(|p| p as u32)),
        );
        host.resize(2 * batch, 0);
        host.extend(
            steps
                .iter()
                .enumerate()
                .flat_map(|(i, s)| std::iter::repeat_n(i as u32, s.tokens.len())),
        );
        host.resize(3 * batch, 0);
        for (i, s) in steps.iter().enumerate() {
            host.extend_from_slice(&s.kv.pages);
            host.resize(3 * batch + (i + 1) * width, 0);
        }
    }

    /// Sends the packed inputs in one copy: all but the ids where those are on the device
    /// already, and nothing where the rest is too (a greedy step that takes no new page).
    fn send_inputs(&mut self, kind: StepKind) -> Result<()> {
        let batch = self.max_batch;
        let inputs = &mut self.inputs;
        let host = &inputs.packed;
        let skip = if kind == StepKind::Host { 0 } else { batch };
        if skip > 0 && inputs.sent.get(skip..) == Some(&host[skip..]) {
            return Ok(());
        }
        let block = inputs.block;
        inputs.sent.clear();
        self.backend
            .write_u32(block.slice(skip * 4, block.len - skip * 4), &host[skip..])?;
        std::mem::swap(&mut inputs.sent, &mut inputs.packed);
        Ok(())
    }

    /// The layer loop, written once.
    fn layers(&self, n: usize, plan: &B::StepPlan) -> Result<()> {
        let c = &self.local;
        let shape = c.attention();
        let (b, s) = (&self.backend, &self.scratch);
        let positions = self.inputs.positions();
        let pages = PagedKv {
            block_tables: self.inputs.tables(),
            table_width: self.cache.table_width,
            token_seqs: self.inputs.token_seqs(),
            page_size: PAGE_SIZE,
        };
        b.embed(&self.weights.token_embd, self.inputs.ids(), s.x, n)?;
        if let Some(factor) = c.embed_scale {
            b.scale(s.x, factor, n * c.dim)?;
        }
        let layers = self.weights.layers.iter().zip(self.cache.k.iter().zip(&self.cache.v));
        for (i, (layer, (k_cache, v_cache))) in layers.enumerate() {
            // Attention block: the residual stream, normalized on the way into Q, K and V.
            let attn_in = self.normed(s.x, layer.attn_norm);
            b.matmul_many(attn_in, &[&layer.wq, &layer.wk, &layer.wv], &[s.q, s.k, s.v], n)?;
            if let Some([bq, bk, bv]) = layer.qkv_bias {
                b.add_bias(s.q, bq, n, shape.q_width())?;
                b.add_bias(s.k, bk, n, shape.kv_width())?;
                b.add_bias(s.v, bv, n, shape.kv_width())?;
            }
            // Qwen3 normalizes each head of Q and K (rows of head_dim) before the rotation.
            let (q, k) = match layer.qk_norm {
                Some(weights) => {
                    let out = [s.q_normed, s.k_normed];
                    b.head_norms([s.q, s.k], weights, out, n, shape, c.rms_eps)?;
                    (s.q_normed, s.k_normed)
                }
                None => (s.q, s.k),
            };
            let (freqs, rope) = match (self.freqs.local, c.local_rope()) {
                (Some(table), Some(rope)) if c.slides(i) => (table, rope),
                _ => (self.freqs.global, c.rope),
            };
            let new = NewRows {
                q,
                k,
                v: s.v,
                freqs,
                rope,
            };
            let kv = AttentionKv {
                k_cache: *k_cache,
                v_cache: *v_cache,
                positions,
                pages,
                scores: c.scores(i),
                plan,
            };
            let ffn_in = self.normed(s.x, layer.ffn_norm);
            match (layer.post_norms, &self.group) {
                (None, None) => {
                    let proj = Projection {
                        wo: &layer.wo,
                        attn: s.attn,
                        residual: Residual {
                            stream: s.x,
                            scratch: s.proj,
                        },
                    };
                    b.rope_attend_and_project(new, kv, proj, n, shape)?;
                    // The projection lands in the residual stream, so its bias can be added there.
                    if let Some(bo) = layer.o_bias {
                        b.add_bias(s.x, bo, n, c.dim)?;
                    }
                    // Feed-forward block, the same way.
                    match &layer.ffn {
                        FeedForwardWeights::Dense { gate, up, down } => {
                            let ffn = FeedForward {
                                gate,
                                up,
                                down,
                                activation: c.activation,
                            };
                            b.feed_forward(ffn_in, ffn, s.feed_forward(), s.x, n)?;
                        }
                        FeedForwardWeights::Mixture(m) => {
                            let k = c.experts.as_ref().map_or(0, |e| e.used);
                            b.mixture(ffn_in, self.mixture(m), s.mixture(k), s.x, n)?;
                        }
                    }
                }
                // Each block's output is computed apart first: to be normalized before it joins
                // the stream, or, split across ranks, to be summed over them.
                (post_norms, _) => {
                    let FeedForwardWeights::Dense { gate, up, down } = &layer.ffn else {
                        return Err(Error::Model(
                            "mixture-of-experts layers with post-norms or split across ranks are not supported".into(),
                        ));
                    };
                    let [post_attn, post_ffn] = post_norms.map_or([None; 2], |norms| norms.map(Some));
                    b.rope_kv_write(new, kv, n, shape)?;
                    b.attention(q, kv, s.attn, n, shape)?;
                    b.matmul(s.attn, &layer.wo, s.proj, n)?;
                    self.reduce(s.proj, n)?;
                    if let Some(bo) = layer.o_bias {
                        b.add_bias(s.proj, bo, n, c.dim)?;
                    }
                    self.join_stream(s.proj, post_attn, n)?;
                    b.gate_up_glu(ffn_in, [gate, up], s.feed_forward().glu(), n, c.activation)?;
                    b.matmul(s.hidden, down, s.proj, n)?;
                    self.reduce(s.proj, n)?;
                    self.join_stream(s.proj, post_ffn, n)?;
                }
            }
        }
        Ok(())
    }

    /// A layer's mixture block as the backend op takes it.
    fn mixture<'a>(&self, m: &'a MixtureWeights<B::Weight>) -> Mixture<'a, B::Weight> {
        let (c, activation) = (&self.config, self.config.activation);
        let experts = c.experts.as_ref();
        Mixture {
            router: &m.router,
            routing: Routing {
                n_experts: m.gate.len(),
                k: experts.map_or(0, |e| e.used),
                renormalize: experts.is_some_and(|e| e.renormalize),
            },
            experts: ExpertSet {
                gate: &m.gate,
                up: &m.up,
                down: &m.down,
                activation,
            },
            shared: m.shared.as_ref().map(|sh| SharedExpert {
                ffn: FeedForward {
                    gate: &sh.gate,
                    up: &sh.up,
                    down: &sh.down,
                    activation,
                },
                gate: &sh.gate_inp,
            }),
        }
    }

    /// `x += rows` over the step's `n` rows, or `x += rms_norm(rows) * weight` with a norm.
    fn join_stream(&self, rows: BlockHandle, norm: Option<BlockHandle>, n: usize) -> Result<()> {
        let (b, s, c) = (&self.backend, &self.scratch, &self.local);
        match norm {
            Some(weight) => {
                b.rms_norm(rows, weight, s.normed, n, c.dim, c.rms_eps)?;
                b.add(s.x, s.normed, n * c.dim)
            }
            None => b.add(s.x, rows, n * c.dim),
        }
    }

    /// Sums the step's `n` rows of `rows` (of the model's width) over the ranks, where the
    /// model is split: each rank's is the product of its share of a matrix's input columns.
    fn reduce(&self, rows: BlockHandle, n: usize) -> Result<()> {
        match &self.group {
            Some(group) => group.comm.all_reduce_sum(&self.backend, rows, n * self.local.dim),
            None => Ok(()),
        }
    }

    /// Rows of `x` under the RMS norm of `weight`, as a matmul input.
    fn normed(&self, x: BlockHandle, weight: BlockHandle) -> Input {
        Input::RmsNormed {
            x,
            weight,
            eps: self.config.rms_eps,
            scratch: self.scratch.normed,
        }
    }

    /// Final norm and LM head of `n` rows of the last step from `first`, into `scratch.logits`:
    /// split across ranks, each rank's rows of the vocabulary, gathered.
    fn lm_head(&self, first: usize, n: usize) -> Result<()> {
        let (b, s, dim) = (&self.backend, &self.scratch, self.config.dim);
        let x = s.x.slice(first * dim * 4, n * dim * 4);
        let input = self.normed(x, self.weights.output_norm);
        match &self.group {
            None => b.matmul_many(input, &[self.weights.lm_head()], &[s.logits], n)?,
            Some(group) => {
                b.matmul_many(input, &[self.weights.lm_head()], &[s.logits_part], n)?;
                group
                    .comm
                    .all_gather(b, s.logits_part, s.logits, n, &group.vocab_widths)?;
            }
        }
        match self.config.final_softcap {
            Some(cap) => self
                .backend
                .softcap(self.scratch.logits, cap, n * self.config.vocab_size),
            None => Ok(()),
        }
    }

    /// Final norm and LM head for `output_rows` (ascending rows of the last step), each run of
    /// consecutive rows that want the same a few at a time (`run_len`), into `sink`.
    fn outputs_for(&mut self, sink: &mut impl StepSink) -> Result<()> {
        self.share(|model| {
            let rows = &model.output_rows;
            let mut runs = Vec::new();
            let mut i = 0;
            while i < rows.len() {
                let n = run_len(rows, i);
                runs.push((rows[i].row, n));
                i += n;
            }
            Work::Heads(runs)
        })?;
        let outputs = self.outputs_to(sink);
        self.stop_on_error(outputs)
    }

    fn outputs_to(&mut self, sink: &mut impl StepSink) -> Result<()> {
        let vocab = self.config.vocab_size;
        let words = vocab.div_ceil(32);
        let (b, s, rows) = (&self.backend, &self.scratch, &self.output_rows);
        let mut ids = [0u32; LOGIT_ROWS_PER_STEP];
        let mut i = 0;
        while i < rows.len() {
            let OutputRow { row: first, want, .. } = rows[i];
            let n = run_len(rows, i);
            self.lm_head(first, n)?;
            if want == Want::Logits {
                b.read_f32(s.logits, &mut self.logits[..n * vocab])?;
                for (r, l) in rows[i..i + n].iter().zip(self.logits[..n * vocab].chunks_exact(vocab)) {
                    sink.output(r.owner, StepOutput::Logits(l));
                }
            } else {
                let allowed = match want {
                    Want::ConstrainedArgmax => {
                        let bits = &mut self.allowed[..n * words];
                        for (r, row_bits) in rows[i..i + n].iter().zip(bits.chunks_exact_mut(words)) {
                            sink.allowed(r.owner, row_bits);
                        }
                        b.write_u32(s.allowed, bits)?;
                        Some(s.allowed)
                    }
                    _ => None,
                };
                b.argmax(s.logits, s.argmax, n, vocab, allowed)?;
                b.read_u32(s.argmax, &mut ids[..n])?;
                for (r, &id) in rows[i..i + n].iter().zip(&ids[..n]) {
                    sink.output(r.owner, StepOutput::Argmax(id));
                }
            }
            i += n;
        }
        Ok(())
    }
}

/// How many of `rows` from `i` on one LM-head step takes: consecutive rows that want the same,
/// at most `LOGIT_ROWS_PER_STEP`.
fn run_len(rows: &[OutputRow], i: usize) -> usize {
    let OutputRow { row: first, want, .. } = rows[i];
    let mut n = 1;
    while i + n < rows.len() && n < LOGIT_ROWS_PER_STEP && (rows[i + n].row, rows[i + n].want) == (first + n, want) {
        n += 1;
    }
    n
}

/// Widths (values per token) of the scratch buffers, in `Scratch` field order up to `k_normed`.
/// The feed-forward rows also serve a shared expert.
fn scratch_widths(c: &ModelConfig) -> [usize; 12] {
    let a = c.attention();
    let (q, kv) = (a.q_width(), a.kv_width());
    let (qn, kn) = if c.qk_norm { (q, kv) } else { (0, 0) };
    let ffn = c
        .experts
        .as_ref()
        .and_then(|e| e.shared_ffn_dim)
        .map_or(c.ffn_dim, |w| w.max(c.ffn_dim));
    [c.dim, c.dim, q, kv, kv, q, c.dim, ffn, ffn, ffn, qn, kn]
}

/// Widths (values per token, 4 bytes each) of the mixture blocks' scratch in `Scratch` field
/// order from `router_logits`: the router's logits, the k routes' ids and weights, the k
/// gathered rows of each token and the experts' rows for them, the pairs' grouping by expert
/// (`ExpertScratch::groups`: its per-expert part counted in every token's, which covers a step
/// of one), the shared expert's gate logit.
fn mixture_widths(c: &ModelConfig) -> [usize; 10] {
    match &c.experts {
        None => [0; 10],
        Some(e) => {
            let (k, shared_gate) = (e.used, usize::from(e.shared_ffn_dim.is_some()));
            let (rows, hidden) = (k * c.dim, k * e.ffn_dim);
            let groups = ExpertScratch::groups_len(e.count, k);
            [e.count, k, k, rows, hidden, hidden, hidden, rows, groups, shared_gate]
        }
    }
}

/// Arena bytes of the scratch, for a rank whose LM head has `head_rows` rows of the vocabulary
/// (0 on one rank).
fn scratch_bytes(c: &ModelConfig, max_batch: usize, head_rows: usize) -> usize {
    let activations: usize = scratch_widths(c)
        .iter()
        .chain(&mixture_widths(c))
        .map(|w| (w * max_batch * 4).next_multiple_of(64))
        .sum();
    let outputs = (LOGIT_ROWS_PER_STEP * (c.vocab_size + 1) * 4).next_multiple_of(64);
    let allowed = (LOGIT_ROWS_PER_STEP * c.vocab_size.div_ceil(32) * 4).next_multiple_of(64);
    let part = (LOGIT_ROWS_PER_STEP * head_rows * 4).next_multiple_of(64);
    activations + outputs + part + allowed + 256
}

impl Scratch {
    fn new<B: Backend>(b: &mut B, c: &ModelConfig, max_batch: usize, head_rows: usize) -> Result<Scratch> {
        let [x, normed, q, k, v, attn, proj, gate, up, hidden, q_normed, k_normed] = scratch_widths(c);
        let [router_logits, route_ids, route_weights, expert_rows, expert_gate, expert_up, expert_hidden, expert_out, expert_groups, shared_gates] =
            mixture_widths(c);
        let mut alloc = |width: usize| b.alloc(width * max_batch * 4);
        Ok(Scratch {
            x: alloc(x)?,
            normed: alloc(normed)?,
            q: alloc(q)?,
            k: alloc(k)?,
            v: alloc(v)?,
            attn: alloc(attn)?,
            proj: alloc(proj)?,
            gate: alloc(gate)?,
            up: alloc(up)?,
            hidden: alloc(hidden)?,
            q_normed: alloc(q_normed)?,
            k_normed: alloc(k_normed)?,
            router_logits: alloc(router_logits)?,
            route_ids: alloc(route_ids)?,
            route_weights: alloc(route_weights)?,
            expert_rows: alloc(expert_rows)?,
            expert_gate: alloc(expert_gate)?,
            expert_up: alloc(expert_up)?,
            expert_hidden: alloc(expert_hidden)?,
            expert_out: alloc(expert_out)?,
            expert_groups: alloc(expert_groups)?,
            shared_gates: alloc(shared_gates)?,
            logits: b.alloc(LOGIT_ROWS_PER_STEP * c.vocab_size * 4)?,
            logits_part: b.alloc(LOGIT_ROWS_PER_STEP * head_rows * 4)?,
            allowed: b.alloc(LOGIT_ROWS_PER_STEP * c.vocab_size.div_ceil(32) * 4)?,
            argmax: b.alloc(LOGIT_ROWS_PER_STEP * 4)?,
        })
    }
}
