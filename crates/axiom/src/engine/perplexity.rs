//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it: the token stream is cut
//! into chunks of `n_ctx` (a partial last chunk is dropped), each chunk is evaluated from an
//! empty cache (its first token replaced by BOS when the model adds one), and the logits at
//! positions `n_ctx/2 .. n_ctx-1` score the next token.

use crate::backend::Backend;
use crate::model::{Llama, LogitRows, PagePool};
use crate::{Error, Result};

#[derive(Debug, Clone, serde::Serialize)]
pub struct Perplexity {
    pub n_ctx: usize,
    pub chunks: usize,
    pub scored_tokens: usize,
    /// Perplexity after each chunk, as llama.cpp prints it.
    pub running: Vec<f64>,
    pub perplexity: f64,
}

pub fn perplexity<B: Backend>(
    model: &mut Llama<B>,
    pages: &mut PagePool,
    tokens: &[u32],
    n_ctx: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    if n_ctx < 4 {
        return Err(Error::InvalidArgument(format!(
            "context {n_ctx} is too small for perplexity"
        )));
    }
    let chunks = tokens.len() / n_ctx;
    if chunks == 0 {
        return Err(Error::InvalidArgument(format!(
            "{} tokens are fewer than one chunk of {n_ctx}",
            tokens.len()
        )));
    }
    let first = n_ctx / 2;
    let mut kv = model.new_kv_cache(n_ctx);
    let mut nll = 0.0f64;
    let mut scored = 0usize;
    let mut running = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        pages.truncate(&mut kv, 0);
        pages.reserve(&mut kv, chunk.len())?;
        let targets = &tokens[c * n_ctx..(c + 1) * n_ctx];
        model.forward(&chunk, &mut kv, LogitRows::From(first), |row, logits| {
            if row + 1 < n_ctx {
                nll -= log_softmax_at(logits, targets[row + 1] as usize);
                scored += 1;
            }
        })?;
        pages.after_step(&mut kv);
        let ppl = (nll / scored as f64).exp();
        running.push(ppl);
        on_chunk(c + 1, chunks, ppl);
    }
    pages.free(&mut kv);
    Ok(Perplexity {
        n_ctx,
        chunks,
        scored_tokens: scored,
        perplexity: *running.last().unwrap_or(&f64::NAN),
        running,
    })
}

fn log_softmax_at(logits: &[f32], i: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[i] as f64 - max - sum.ln()
}
