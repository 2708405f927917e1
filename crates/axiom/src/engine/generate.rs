//! The generation loop: prefill the prompt in one batch, then one token per step until an
//! end-of-generation token, the token limit, a stop string or a full context.

use super::sampler::Sampler;
use crate::backend::Backend;
use crate::model::{GreedyDecode, KvCache, Llama};
use crate::tokenizer::{TextStream, Tokenizer};
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndOfGeneration,
    MaxTokens,
    StopString,
    ContextFull,
    Cancelled,
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
    model: &mut Llama<B>,
    tokenizer: &Tokenizer,
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
    let capacity = kv.capacity();
    let start = Instant::now();
    if sampler.config().is_plain_greedy() {
        let decode = GreedyDecode::new(model, kv, prompt)?;
        let prompt_time = start.elapsed();
        decode_loop(
            Tokens::Greedy(decode),
            tokenizer,
            capacity,
            options,
            on_text,
            prompt_time,
        )
    } else {
        model.forward_last(prompt, kv)?;
        let prompt_time = start.elapsed();
        let history = prompt.to_vec();
        let tokens = Tokens::Sampled {
            model,
            kv,
            sampler,
            history,
        };
        decode_loop(tokens, tokenizer, capacity, options, on_text, prompt_time)
    }
}

/// Where [`generate`]'s tokens come from.
enum Tokens<'a, B: Backend> {
    Greedy(GreedyDecode<'a, B>),
    /// From the logits of the last step, on the host.
    Sampled {
        model: &'a mut Llama<B>,
        kv: &'a mut KvCache,
        sampler: &'a mut Sampler,
        /// Prompt and generated tokens, for the penalties.
        history: Vec<u32>,
    },
}

impl<B: Backend> Tokens<'_, B> {
    /// Tokens the sequence holds before the next one.
    fn sequence_len(&self) -> usize {
        match self {
            Tokens::Greedy(decode) => decode.sequence_len(),
            Tokens::Sampled { kv, .. } => kv.len(),
        }
    }

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
            Tokens::Sampled { model, kv, history, .. } => {
                history.push(token);
                model.forward_last(&[token], kv).map(|_| ())
            }
        }
    }
}

fn decode_loop<B: Backend>(
    mut source: Tokens<B>,
    tokenizer: &Tokenizer,
    capacity: usize,
    options: &GenerateOptions,
    mut on_text: impl FnMut(&str),
    prompt_time: Duration,
) -> Result<Generation> {
    let start = Instant::now();
    let mut tokens = Vec::new();
    let mut stream = TextStream::default();
    let mut stops = StopMatcher::new(options.stop.clone());
    let mut stop_reason = StopReason::MaxTokens;
    while tokens.len() < options.max_tokens {
        // The limits are known before the token: only an end of generation, a stop string or a
        // cancel can leave a greedy step queued for nothing.
        let room = source.sequence_len() < capacity;
        let token = source.next(tokens.len() + 1 < options.max_tokens && room)?;
        if tokenizer.is_end_of_generation(token) {
            stop_reason = StopReason::EndOfGeneration;
            break;
        }
        tokens.push(token);
        if let Some(piece) = stream.push(tokenizer, token)? {
            if stops.push(&piece, &mut on_text) {
                stop_reason = StopReason::StopString;
                break;
            }
        }
        if tokens.len() == options.max_tokens {
            break;
        }
        if !room {
            stop_reason = StopReason::ContextFull;
            break;
        }
        if options
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        {
            stop_reason = StopReason::Cancelled;
            break;
        }
        source.run(token)?;
    }
    drop(source);
    if stop_reason != StopReason::StopString {
        if let Some(rest) = stream.finish(tokenizer)? {
            if stops.push(&rest, &mut on_text) {
                stop_reason = StopReason::StopString;
            }
        }
        stops.flush(&mut on_text);
    }
    Ok(Generation {
        tokens,
        text: stops.text,
        stop_reason,
        prompt_time,
        generation_time: start.elapsed(),
    })
}

/// Accumulates the generated text, emitting only what cannot be the start of a stop string.
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    pub text: String,
    emitted: usize,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds text; returns true when a stop string has appeared (the text is cut before it).
    pub fn push(&mut self, piece: &str, on_text: &mut impl FnMut(&str)) -> bool {
        self.text.push_str(piece);
        let search_from = self
            .emitted
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = self.text.floor_char_boundary(search_from);
        let hit = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|i| search_from + i))
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.flush(on_text);
            return true;
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let held = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|prefix| self.text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let ready = self.text.len() - held;
        if ready > self.emitted {
            on_text(&self.text[self.emitted..ready]);
            self.emitted = ready;
        }
        false
    }

    pub fn flush(&mut self, on_text: &mut impl FnMut(&str)) {
        if self.text.len() > self.emitted {
            on_text(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool, Vec<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(stops);
        let mut out = Vec::new();
        let mut hit = false;
        for p in pieces {
            if m.push(p, &mut |s| out.push(s.to_string())) {
                hit = true;
                break;
            }
        }
        if !hit {
            m.flush(&mut |s| out.push(s.to_string()));
        }
        (m.text, hit, out)
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_emitted() {
        let (text, hit, out) = run(&["\n\nUser:"], &["Hello", " there", "\n", "\nUs", "er:", " more"]);
        assert!(hit);
        assert_eq!(text, "Hello there");
        assert_eq!(out.concat(), "Hello there");
    }

    #[test]
    fn held_back_prefix_is_released_when_it_does_not_complete() {
        let (text, hit, out) = run(&["END"], &["a E", "N", "x b"]);
        assert!(!hit);
        assert_eq!(text, "a ENx b");
        assert_eq!(out.concat(), "a ENx b");
        assert_eq!(out[0], "a ");
    }
}
