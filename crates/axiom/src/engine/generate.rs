//! The generation loop: prefill the prompt in one batch, then one token per step until an
//! end-of-generation token, the token limit, a stop string or a full context.

use super::output::{OutputLimits, OutputState, StopReason};
use super::sampler::Sampler;
use super::session::Session;
use crate::backend::Backend;
use crate::model::{GreedyDecode, KvCache, Llama, PagePool};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Generation stops before the first occurrence of any of these in the text.
    pub stop: Vec<String>,
    /// Set from elsewhere (a Ctrl-C handler, a disconnected client) to stop after the current token.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    pub prompt_time: Duration,
    pub generation_time: Duration,
}

/// Generates after `prompt` (appended to whatever `kv` already holds), calling `on_text` with
/// each piece of text as soon as it is certain (never part of a stop string or a character).
///
/// Greedy sampling without penalties chooses each token on the device, a step ahead of the host
/// ([`GreedyDecode`]); other sampling brings each step's logits back.
pub fn generate<B: Backend>(
    session: &mut Session<B>,
    kv: &mut KvCache,
    prompt: &[u32],
    sampler: &mut Sampler,
    options: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::InvalidArgument("the prompt has no tokens".into()));
    }
    if kv.len() + prompt.len() > kv.capacity() {
        return Err(Error::ContextOverflow {
            prompt: kv.len() + prompt.len(),
            generate: options.max_tokens,
            context: kv.capacity(),
        });
    }
    let limits = OutputLimits {
        max_tokens: options.max_tokens,
        // The last position's logits still give a token, returned without being run.
        context_room: kv.capacity() - (kv.len() + prompt.len()) + 1,
        ignore_eos: false,
    };
    let output = OutputState::new(options.stop.clone(), limits);
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = session;
    let start = Instant::now();
    if sampler.config().is_plain_greedy() {
        let decode = GreedyDecode::new(model, pages, kv, prompt)?;
        let prompt_time = start.elapsed();
        let tokens = Tokens::Greedy(decode);
        decode_loop(tokens, tokenizer, output, options, on_text, prompt_time)
    } else {
        pages.reserve(kv, prompt.len())?;
        model.forward_last(prompt, kv)?;
        pages.index_full_pages(kv);
        let prompt_time = start.elapsed();
        let history = prompt.to_vec();
        let tokens = Tokens::Sampled {
            model,
            pages,
            kv,
            sampler,
            history,
        };
        decode_loop(tokens, tokenizer, output, options, on_text, prompt_time)
    }
}

/// Where [`generate`]'s tokens come from.
enum Tokens<'a, B: Backend> {
    Greedy(GreedyDecode<'a, B>),
    /// From the logits of the last step, on the host.
    Sampled {
        model: &'a mut Llama<B>,
        pages: &'a mut PagePool,
        kv: &'a mut KvCache,
        sampler: &'a mut Sampler,
        /// Prompt and generated tokens, for the penalties.
        history: Vec<u32>,
    },
}

impl<B: Backend> Tokens<'_, B> {
    /// The next token; `will_run` says whether it will be run whatever it is (greedy decoding
    /// queues its step before the token arrives).
    fn next(&mut self, will_run: bool) -> Result<u32> {
        match self {
            Tokens::Greedy(decode) => decode.next_token(will_run),
            Tokens::Sampled {
                model,
                sampler,
                history,
                ..
            } => Ok(sampler.sample(model.last_logits(), history)),
        }
    }

    /// Runs the token `next` gave, unless it already runs.
    fn run(&mut self, token: u32) -> Result<()> {
        match self {
            Tokens::Greedy(_) => Ok(()),
            Tokens::Sampled {
                model,
                pages,
                kv,
                history,
                ..
            } => {
                history.push(token);
                pages.reserve(kv, 1)?;
                model.forward_last(&[token], kv)?;
                pages.index_full_pages(kv);
                Ok(())
            }
        }
    }
}

fn decode_loop<B: Backend>(
    mut source: Tokens<B>,
    tokenizer: &Tokenizer,
    mut output: OutputState,
    options: &GenerateOptions,
    mut on_text: impl FnMut(&str),
    prompt_time: Duration,
) -> Result<Generation> {
    let start = Instant::now();
    let mut tokens = Vec::new();
    // Only a limit of no tokens at all ends the loop before a token does.
    let mut stop_reason = StopReason::MaxTokens;
    while output.remaining() > 0 {
        // The limits are known before the token: only an end of generation, a stop string or a
        // cancel can leave a greedy step queued for nothing.
        let token = source.next(output.remaining() > 1)?;
        let step = output.push(tokenizer, token)?;
        if step.token_is_output {
            tokens.push(token);
        }
        if !step.text.is_empty() {
            on_text(&step.text);
        }
        if let Some(reason) = step.finished {
            stop_reason = reason;
            break;
        }
        if options
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        {
            let ending = output.finish(tokenizer, StopReason::Cancelled)?;
            if !ending.text.is_empty() {
                on_text(&ending.text);
            }
            stop_reason = ending.reason;
            break;
        }
        source.run(token)?;
    }
    drop(source);
    Ok(Generation {
        tokens,
        text: output.into_text(),
        stop_reason,
        prompt_time,
        generation_time: start.elapsed(),
    })
}
