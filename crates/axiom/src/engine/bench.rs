//! `axiom bench`: prompt processing and generation throughput, measured like llama-bench.
//!
//! `pp N`: N tokens in one batch from an empty cache, logits for the last only. `tg N`: N tokens
//! one at a time from an empty cache, decoded greedily as `axiom run` does at temperature 0 (each
//! chosen on the device, which runs a step ahead of the host; llama-bench instead brings each
//! step's logits back and waits for them). Each test runs once to warm up, then `repetitions`
//! times. At a depth of d (llama-bench's `-d`), each repetition starts after d tokens of context,
//! prefilled once and not timed.

use crate::backend::Backend;
use crate::model::{GreedyDecode, Llama, LogitRows, PagePool};
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
    /// As llama-bench names it: `tg128`, or `tg128 @ d4096` after context.
    pub test: String,
    pub n_tokens: usize,
    pub depth: usize,
    /// Tokens per second of each repetition.
    pub samples: Vec<f64>,
    pub mean: f64,
    pub stddev: f64,
}

pub fn run_test<B: Backend>(
    model: &mut Llama<B>,
    pages: &mut PagePool,
    test: Test,
    depth: usize,
    repetitions: usize,
) -> Result<BenchResult> {
    let n = test.tokens();
    if n == 0 {
        return Err(Error::InvalidArgument(format!("{} runs no tokens", test.name())));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n as u64);
    let vocab = model.config.vocab_size as u32;
    let mut random = |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(0..vocab)).collect() };
    let tokens = random(n);
    let context = random(depth);
    let mut kv = model.new_kv_cache(depth + n);
    if depth > 0 {
        pages.reserve(&mut kv, depth)?;
        model.forward(&context, &mut kv, LogitRows::None, |_, _| {})?;
        pages.after_step(&mut kv);
    }
    let mut samples = Vec::new();
    for rep in 0..=repetitions {
        pages.truncate(&mut kv, depth);
        model.backend.synchronize()?;
        let start = Instant::now();
        match test {
            Test::Prompt(_) => {
                pages.reserve(&mut kv, tokens.len())?;
                model.forward(&tokens, &mut kv, LogitRows::Last, |_, _| {})?;
                pages.after_step(&mut kv);
            }
            Test::Generation(_) => {
                let mut decode = GreedyDecode::new(model, pages, &mut kv, &tokens[..1])?;
                for i in 1..=n {
                    decode.next_token(i < n)?;
                }
            }
        }
        model.backend.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        if rep > 0 {
            samples.push(n as f64 / seconds);
        }
    }
    pages.free(&mut kv);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (samples.len().max(2) - 1) as f64;
    let name = match depth {
        0 => test.name(),
        d => format!("{} @ d{d}", test.name()),
    };
    Ok(BenchResult {
        test: name,
        n_tokens: n,
        depth,
        samples,
        mean,
        stddev: var.sqrt(),
    })
}
