//! `axiom bench`: prompt processing and generation throughput, measured like llama-bench.
//!
//! `pp N`: N tokens in one batch from an empty cache, logits for the last only. `tg N`: N tokens
//! one at a time from an empty cache, decoded greedily as `axiom run` does at temperature 0 (each
//! chosen on the device, which runs a step ahead of the host; llama-bench instead brings each
//! step's logits back and waits for them). Each test runs once to warm up, then `repetitions`
//! times. At a depth of d (llama-bench's `-d`), each repetition starts after d tokens of context,
//! prefilled once and not timed. With `parallel` sequences (llama-batched-bench's `-npl`, and what
//! a server decoding that many streams runs), each step of `tg N` decodes one token of every
//! sequence, its choice brought back as the server's steps bring theirs, and the rate counts them
//! all.

use crate::backend::Backend;
use crate::model::{GreedyDecode, KvCache, Llama, LogitRows, PagePool, SeqStep, StepOutput, StepSink, Want};
use crate::{Error, Result};
use rand::{Rng, SeedableRng};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Test {
    Prompt(usize),
    Generation(usize),
}

impl Test {
    pub fn name(&self) -> String {
        match self {
            Test::Prompt(n) => format!("pp{n}"),
            Test::Generation(n) => format!("tg{n}"),
        }
    }
    pub fn tokens(&self) -> usize {
        match *self {
            Test::Prompt(n) | Test::Generation(n) => n,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    /// As llama-bench names it: `tg128`, or `tg128 @ d4096` after context; `tg128 x64` for 64
    /// sequences decoding together.
    pub test: String,
    pub n_tokens: usize,
    pub depth: usize,
    pub parallel: usize,
    /// Tokens per second of each repetition.
    pub samples: Vec<f64>,
    pub mean: f64,
    pub stddev: f64,
}

/// Runs `test` `repetitions` times after a warm-up, each after `depth` tokens of context; a
/// generation test decodes `parallel` sequences together. With `profile`, the device profiler
/// collects during the last repetition only (`Kernels::profile`).
pub fn run_test<B: Backend>(
    model: &mut Llama<B>,
    pages: &mut PagePool,
    test: Test,
    depth: usize,
    parallel: usize,
    repetitions: usize,
    profile: bool,
) -> Result<BenchResult> {
    let n = test.tokens();
    if n == 0 {
        return Err(Error::InvalidArgument(format!("{} runs no tokens", test.name())));
    }
    if parallel == 0 || (parallel > 1 && matches!(test, Test::Prompt(_))) {
        return Err(Error::InvalidArgument(format!(
            "{} cannot run as {parallel} sequences: only generation tests run in parallel",
            test.name()
        )));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n as u64);
    let vocab = model.config.vocab_size as u32;
    let mut random = |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(0..vocab)).collect() };
    let tokens = random(n);
    let firsts = random(parallel);
    let context = random(depth);
    let mut kvs: Vec<KvCache> = (0..parallel).map(|_| model.new_kv_cache(depth + n)).collect();
    if depth > 0 {
        for kv in &mut kvs {
            pages.reserve(kv, depth)?;
            model.forward(&context, kv, LogitRows::None, |_, _| {})?;
            pages.after_step(kv);
        }
    }
    let mut samples = Vec::new();
    for rep in 0..=repetitions {
        for kv in &mut kvs {
            pages.truncate(kv, depth);
        }
        let profiled = profile && rep == repetitions;
        if profiled {
            model.backend.profile(true)?;
        }
        model.backend.synchronize()?;
        let start = Instant::now();
        match test {
            Test::Prompt(_) => {
                let kv = &mut kvs[0];
                pages.reserve(kv, tokens.len())?;
                model.forward(&tokens, kv, LogitRows::Last, |_, _| {})?;
                pages.after_step(kv);
            }
            Test::Generation(_) if parallel == 1 => {
                let mut decode = GreedyDecode::new(model, pages, &mut kvs[0], &tokens[..1])?;
                for i in 1..=n {
                    decode.next_token(i < n)?;
                }
            }
            Test::Generation(_) => decode_together(model, pages, &mut kvs, firsts.clone(), n)?,
        }
        model.backend.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        if profiled {
            model.backend.profile(false)?;
        }
        if rep > 0 {
            samples.push((n * parallel) as f64 / seconds);
        }
    }
    for kv in &mut kvs {
        pages.free(kv);
    }
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (samples.len().max(2) - 1) as f64;
    let mut name = test.name();
    if parallel > 1 {
        name += &format!(" x{parallel}");
    }
    if depth > 0 {
        name += &format!(" @ d{depth}");
    }
    Ok(BenchResult {
        test: name,
        n_tokens: n,
        depth,
        parallel,
        samples,
        mean,
        stddev: var.sqrt(),
    })
}

/// `n` greedy steps of every sequence in `kvs` together, starting from `tokens` (one each): each
/// step's choices come back to the host and feed the next, as in the server's decode.
fn decode_together<B: Backend>(
    model: &mut Llama<B>,
    pages: &mut PagePool,
    kvs: &mut [KvCache],
    mut tokens: Vec<u32>,
    n: usize,
) -> Result<()> {
    struct Chosen<'a>(&'a mut [u32]);
    impl StepSink for Chosen<'_> {
        fn allowed(&mut self, _: usize, words: &mut [u32]) {
            words.fill(u32::MAX);
        }
        fn output(&mut self, owner: usize, output: StepOutput) {
            if let StepOutput::Argmax(token) = output {
                self.0[owner] = token;
            }
        }
    }
    for _ in 0..n {
        for kv in kvs.iter_mut() {
            pages.reserve(kv, 1)?;
        }
        let inputs = tokens.clone();
        let mut steps: Vec<SeqStep> = kvs
            .iter_mut()
            .zip(&inputs)
            .map(|(kv, token)| SeqStep {
                kv,
                tokens: std::slice::from_ref(token),
                want: Want::Argmax,
            })
            .collect();
        model.forward_batch(&mut steps, &mut Chosen(&mut tokens))?;
        for kv in kvs.iter_mut() {
            pages.after_step(kv);
        }
    }
    Ok(())
}
