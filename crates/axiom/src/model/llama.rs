//! The Llama forward pass, written once against the [`Backend`] ops.

use super::config::ModelConfig;
use super::weights::{self, TensorSource, Weights};
use crate::backend::{Backend, BlockHandle};
use crate::format::gguf::GgufFile;
use crate::{Error, Result};

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
    /// Tokens of KV cache to reserve room for.
    pub kv_tokens: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_batch: 512,
            kv_tokens: 4096,
        }
    }
}

/// Rows of logits computed per LM-head step, so a long scored range never needs a
/// `[tokens, vocab]` buffer at once.
const LOGIT_ROWS_PER_STEP: usize = 32;

/// The key and value cache of one sequence: per layer, `[capacity, kv_width]` f32.
pub struct KvCache {
    k: Vec<BlockHandle>,
    v: Vec<BlockHandle>,
    capacity: usize,
    len: usize,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forgets tokens from `len` on (the next forward overwrites them).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Per-step activation buffers, sized for `max_batch` tokens.
struct Scratch {
    ids: BlockHandle,
    positions: BlockHandle,
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
}

pub struct Llama<B: Backend> {
    pub config: ModelConfig,
    pub backend: B,
    weights: Weights<B::Weight>,
    /// The rope kernels' table of per-pair frequencies.
    freqs: BlockHandle,
    scratch: Scratch,
    max_batch: usize,
    /// Host copies of a few rows of logits; after `forward_last`, the first row is the last token's.
    logits: Vec<f32>,
    /// Positions of the current step (reused: the decode loop allocates nothing).
    positions: Vec<u32>,
    /// Recorded one-token steps (graph handles), by the KV cache they write (its first block).
    decode_graphs: Vec<(usize, usize)>,
}

impl<B: Backend> Llama<B> {
    pub fn from_gguf(file: &GgufFile, backend: B, options: LoadOptions) -> Result<Llama<B>> {
        Self::load(file, ModelConfig::from_gguf(file)?, backend, options)
    }

    /// Loads the weights `config` calls for from `source` onto `backend`, reserving the arena
    /// for them, the activations of `options.max_batch` tokens and `options.kv_tokens` of cache.
    pub fn load<S: TensorSource + ?Sized>(
        source: &S,
        config: ModelConfig,
        mut backend: B,
        options: LoadOptions,
    ) -> Result<Llama<B>> {
        let max_batch = options.max_batch.max(1);
        let kv_tokens = options.kv_tokens.min(config.context_length).max(1);
        let kv = kv_bytes(&config, kv_tokens, backend.kv_type().bytes());
        let (largest_weight, max_n_in) = weights::largest(&config);
        let steps = max_batch.max(LOGIT_ROWS_PER_STEP);
        let matrices: Vec<usize> = source
            .all()
            .into_iter()
            .filter(|(_, dims, _)| dims.len() == 2)
            .map(|(_, _, b)| b)
            .collect();
        let arena = weights::vector_bytes(&config)
            + scratch_bytes(&config, max_batch)
            + kv
            + backend.weight_bytes(&matrices)
            + backend.staging_bytes(largest_weight, steps, max_n_in)
            + 64 * 256;
        backend.reserve(arena)?;
        let (weights, freqs) = weights::load(source, &config, &mut backend)?;
        let scratch = Scratch::new(&mut backend, &config, max_batch)?;
        backend.prepare(steps, max_n_in)?;
        let logits = vec![0f32; config.vocab_size * LOGIT_ROWS_PER_STEP];
        let positions = Vec::with_capacity(max_batch);
        Ok(Llama {
            config,
            backend,
            weights,
            freqs,
            scratch,
            max_batch,
            logits,
            positions,
            decode_graphs: Vec::new(),
        })
    }

    /// A KV cache for one sequence of up to `capacity` tokens.
    pub fn new_kv_cache(&mut self, capacity: usize) -> Result<KvCache> {
        let bytes = capacity * self.config.attention().kv_width() * self.backend.kv_type().bytes();
        let mut k = Vec::with_capacity(self.config.n_layers);
        let mut v = Vec::with_capacity(self.config.n_layers);
        for _ in 0..self.config.n_layers {
            k.push(self.backend.alloc(bytes)?);
            v.push(self.backend.alloc(bytes)?);
        }
        Ok(KvCache { k, v, capacity, len: 0 })
    }

    pub fn free_kv_cache(&mut self, kv: KvCache) -> Result<()> {
        // Its recorded steps point into its blocks: a later cache must record its own.
        let key = kv.k.first().map_or(0, |b| b.offset);
        self.decode_graphs.retain(|(k, _)| *k != key);
        for block in kv.k.into_iter().chain(kv.v) {
            self.backend.free(block)?;
        }
        Ok(())
    }

    /// Runs `tokens` after the ones already in `kv`, appending theirs. For each row that `rows`
    /// asks for, calls `sink(row index within tokens, logits)`.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        kv: &mut KvCache,
        rows: LogitRows,
        mut sink: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        if kv.len + tokens.len() > kv.capacity {
            return Err(Error::ContextOverflow {
                prompt: kv.len + tokens.len(),
                generate: 0,
                context: kv.capacity,
            });
        }
        let first_scored = match rows {
            LogitRows::None => tokens.len(),
            LogitRows::Last => tokens.len().saturating_sub(1),
            LogitRows::From(i) => i,
        };
        for (step, chunk) in tokens.chunks(self.max_batch).enumerate() {
            let offset = step * self.max_batch;
            let from = first_scored.saturating_sub(offset).min(chunk.len());
            self.step(chunk, kv)?;
            self.logits_for(chunk.len(), from, |row, logits| sink(offset + row, logits))?;
        }
        Ok(())
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

    /// One batch through every layer; leaves the final hidden states in `scratch.x`. A one-token
    /// step is recorded as a graph the first time (where the backend has graphs) and replayed
    /// after: it reads its token and position from device buffers, so one recording serves
    /// every position of the same KV cache.
    fn step(&mut self, tokens: &[u32], kv: &mut KvCache) -> Result<()> {
        let n = tokens.len();
        self.positions.clear();
        self.positions.extend((kv.len..kv.len + n).map(|p| p as u32));
        self.backend.write_u32(self.scratch.ids, tokens)?;
        self.backend.write_u32(self.scratch.positions, &self.positions)?;
        let key = kv.k.first().map_or(0, |b| b.offset);
        if n == 1 {
            if let Some(&(_, graph)) = self.decode_graphs.iter().find(|(k, _)| *k == key) {
                self.backend.replay(graph)?;
            } else if self.backend.begin_capture()? {
                let recorded = self.layers(n, kv);
                let graph = self.backend.end_capture()?;
                recorded?;
                self.decode_graphs.push((key, graph));
                self.backend.replay(graph)?;
            } else {
                self.layers(n, kv)?;
            }
        } else {
            self.layers(n, kv)?;
        }
        kv.len += n;
        Ok(())
    }

    /// The layer loop, written once.
    fn layers(&self, n: usize, kv: &KvCache) -> Result<()> {
        let c = &self.config;
        let shape = c.attention();
        let (b, s) = (&self.backend, &self.scratch);
        b.embed(&self.weights.token_embd, s.ids, s.x, n)?;
        for (layer, (k_cache, v_cache)) in self.weights.layers.iter().zip(kv.k.iter().zip(&kv.v)) {
            // Attention block.
            b.rms_norm(s.x, layer.attn_norm, s.normed, n, c.dim, c.rms_eps)?;
            b.matmul_many(s.normed, &[&layer.wq, &layer.wk, &layer.wv], &[s.q, s.k, s.v], n)?;
            if let Some([bq, bk, bv]) = layer.qkv_bias {
                b.add_bias(s.q, bq, n, shape.q_width())?;
                b.add_bias(s.k, bk, n, shape.kv_width())?;
                b.add_bias(s.v, bv, n, shape.kv_width())?;
            }
            // Qwen3 normalizes each head of Q and K (rows of head_dim) before the rotation.
            let (q, k) = match layer.qk_norm {
                Some([qn, kn]) => {
                    b.rms_norm(s.q, qn, s.q_normed, n * c.n_heads, c.head_dim, c.rms_eps)?;
                    b.rms_norm(s.k, kn, s.k_normed, n * c.n_kv_heads, c.head_dim, c.rms_eps)?;
                    (s.q_normed, s.k_normed)
                }
                None => (s.q, s.k),
            };
            b.rope(q, s.positions, self.freqs, n, c.n_heads, c.head_dim, c.rope)?;
            b.rope(k, s.positions, self.freqs, n, c.n_kv_heads, c.head_dim, c.rope)?;
            b.kv_write(k, s.v, *k_cache, *v_cache, s.positions, n, shape.kv_width())?;
            b.attention(q, *k_cache, *v_cache, s.positions, s.attn, n, shape)?;
            b.matmul(s.attn, &layer.wo, s.proj, n)?;
            b.add(s.x, s.proj, n * c.dim)?;
            // Feed-forward block.
            b.rms_norm(s.x, layer.ffn_norm, s.normed, n, c.dim, c.rms_eps)?;
            b.matmul_many(s.normed, &[&layer.w_gate, &layer.w_up], &[s.gate, s.up], n)?;
            b.swiglu(s.gate, s.up, s.hidden, n * c.ffn_dim)?;
            b.matmul(s.hidden, &layer.w_down, s.proj, n)?;
            b.add(s.x, s.proj, n * c.dim)?;
        }
        Ok(())
    }

    /// Final norm and LM head for rows `from..n` of the last step, a few rows at a time.
    fn logits_for(&mut self, n: usize, from: usize, mut sink: impl FnMut(usize, &[f32])) -> Result<()> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        let (b, s) = (&self.backend, &self.scratch);
        let mut row = from;
        while row < n {
            let rows = (n - row).min(LOGIT_ROWS_PER_STEP);
            let x = s.x.slice(row * dim * 4, rows * dim * 4);
            b.rms_norm(x, self.weights.output_norm, s.normed, rows, dim, self.config.rms_eps)?;
            b.matmul(s.normed, self.weights.lm_head(), s.logits, rows)?;
            b.read_f32(s.logits, &mut self.logits[..rows * vocab])?;
            for (i, l) in self.logits[..rows * vocab].chunks_exact(vocab).enumerate() {
                sink(row + i, l);
            }
            row += rows;
        }
        Ok(())
    }
}

/// Widths (values per token) of the scratch buffers, in `Scratch` field order up to `k_normed`.
fn scratch_widths(c: &ModelConfig) -> [usize; 14] {
    let a = c.attention();
    let (q, kv) = (a.q_width(), a.kv_width());
    let (qn, kn) = if c.qk_norm { (q, kv) } else { (0, 0) };
    [
        1, 1, c.dim, c.dim, q, kv, kv, q, c.dim, c.ffn_dim, c.ffn_dim, c.ffn_dim, qn, kn,
    ]
}

fn scratch_bytes(c: &ModelConfig, max_batch: usize) -> usize {
    let activations: usize = scratch_widths(c)
        .iter()
        .map(|w| (w * max_batch * 4).next_multiple_of(64))
        .sum();
    activations + (LOGIT_ROWS_PER_STEP * c.vocab_size * 4).next_multiple_of(64)
}

fn kv_bytes(c: &ModelConfig, tokens: usize, element_bytes: usize) -> usize {
    2 * c.n_layers * (tokens * c.attention().kv_width() * element_bytes).next_multiple_of(64)
}

impl Scratch {
    fn new<B: Backend>(b: &mut B, c: &ModelConfig, max_batch: usize) -> Result<Scratch> {
        let [ids, positions, x, normed, q, k, v, attn, proj, gate, up, hidden, q_normed, k_normed] = scratch_widths(c);
        let mut alloc = |width: usize| b.alloc(width * max_batch * 4);
        Ok(Scratch {
            ids: alloc(ids)?,
            positions: alloc(positions)?,
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
            logits: b.alloc(LOGIT_ROWS_PER_STEP * c.vocab_size * 4)?,
        })
    }
}
