//! The generation loop: prefill the prompt in one batch, then one token per step until an
//! end-of-generation token, a stop token, the token limit, a stop string, a complete constraint
//! or a full context.

use super::constraint::{Constraint, ConstraintError, ConstraintSpec, Grammars, TokenMask};
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
    /// Generation stops at any of these tokens, which are left out of the text.
    pub stop_tokens: Vec<u32>,
    /// What the output must match; it ends once the constraint is complete.
    pub constraint: Option<ConstraintSpec>,
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
/// Greedy sampling without bias, penalties or constraint chooses each token on the device, a step
/// ahead of the host ([`GreedyDecode`]); other sampling brings each step's logits back. A
/// constraint's mask for the next token is computed on another thread while the model runs.
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
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = session;
    let vocab = tokenizer.vocab_size();
    let biased = sampler
        .config()
        .logit_bias
        .iter()
        .map(|&(token, _)| ("logit bias", token));
    let stopping = options.stop_tokens.iter().map(|&token| ("stop tokens", token));
    if let Some((what, token)) = biased.chain(stopping).find(|&(_, token)| token as usize >= vocab) {
        return Err(Error::InvalidArgument(format!(
            "token id {token} in the {what} is outside the vocabulary of {vocab}"
        )));
    }
    let output = OutputState::new(options.stop.clone(), options.stop_tokens.clone(), limits);
    let constraint = match &options.constraint {
        Some(spec) => Some(Box::new(Grammars::new(tokenizer)?.compile(spec)?)),
        None => None,
    };
    let start = Instant::now();
    if sampler.config().is_plain_greedy() && constraint.is_none() {
        let decode = GreedyDecode::new(model, pages, kv, prompt)?;
        let prompt_time = start.elapsed();
        let tokens = Tokens::Greedy(decode);
        decode_loop(tokens, tokenizer, output, options, on_text, prompt_time)
    } else {
        let mut tokens = Tokens::Sampled {
            model,
            pages,
            kv,
            sampler,
            history: prompt.to_vec(),
            constraint,
            mask: None,
        };
        tokens.run_with_mask(prompt)?;
        let prompt_time = start.elapsed();
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
        /// Boxed: a parser is large beside the other variant.
        constraint: Option<Box<Constraint>>,
        /// The constraint's mask for the next token.
        mask: Option<TokenMask>,
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
                kv,
                sampler,
                history,
                mask,
                ..
            } => sampler
                // Every known token has run: the new one takes the next position.
                .sample(model.last_logits(), history, mask.as_ref(), kv.len())
                .ok_or_else(|| {
                    Error::InvalidArgument("the constraint and the logit bias leave no token to sample".into())
                }),
        }
    }

    /// Advances the constraint by an output token; true once it is complete.
    fn accept(&mut self, token: u32) -> Result<bool> {
        match self {
            Tokens::Sampled {
                constraint: Some(constraint),
                ..
            } => Ok(constraint.accept(token)?),
            _ => Ok(false),
        }
    }

    /// Runs the token `next` gave, unless it already runs.
    fn run(&mut self, token: u32) -> Result<()> {
        match self {
            Tokens::Greedy(_) => Ok(()),
            Tokens::Sampled { history, .. } => {
                history.push(token);
                self.run_with_mask(&[token])
            }
        }
    }

    /// Runs `tokens` through the model while the constraint's next mask is computed beside it.
    fn run_with_mask(&mut self, tokens: &[u32]) -> Result<()> {
        let Tokens::Sampled {
            model,
            pages,
            kv,
            constraint,
            mask,
            ..
        } = self
        else {
            return Ok(());
        };
        pages.reserve(kv, tokens.len())?;
        let (forward, next_mask) = std::thread::scope(|s| {
            let masking = constraint.as_mut().map(|c| s.spawn(|| c.mask()));
            let forward = model.forward_last(tokens, kv).map(|_| ());
            (forward, masking.map(|m| m.join()))
        });
        forward?;
        pages.after_step(kv);
        *mask = match next_mask {
            None => None,
            Some(Ok(computed)) => Some(computed?),
            Some(Err(_)) => return Err(ConstraintError("the constraint's mask computation panicked".into()).into()),
        };
        Ok(())
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
        let mut step = output.push(tokenizer, token)?;
        if step.token_is_output {
            tokens.push(token);
            if source.accept(token)? {
                output.end_with(&mut step, tokenizer, StopReason::ConstraintComplete)?;
            }
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
