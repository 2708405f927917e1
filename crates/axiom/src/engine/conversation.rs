//! A multi-turn conversation over one KV cache: each turn runs only what the cache does not
//! already hold (the new message and the template's glue), and the oldest turns are dropped
//! when the context fills up.

use super::generate::{generate, GenerateOptions, Generation};
use super::output::StopReason;
use super::sampler::Sampler;
use super::session::Session;
use crate::backend::Backend;
use crate::chat::Message;
use crate::model::{KvCache, PagePool};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// What `/save` writes and `/load` reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transcript {
    pub system: Option<String>,
    pub messages: Vec<Message>,
}

/// The outcome of one turn.
#[derive(Debug)]
pub struct Turn {
    pub generation: Generation,
    /// Tokens this turn ran through the model before generating (the part not already cached).
    pub prompt_tokens_run: usize,
    /// Earlier turns dropped to make room, if any.
    pub dropped_turns: usize,
}

pub struct Conversation {
    pub transcript: Transcript,
    kv: KvCache,
    /// The exact text whose tokens are in `kv`.
    cached_text: String,
}

impl Conversation {
    pub fn new<B: Backend>(session: &mut Session<B>, context: usize, system: Option<String>) -> Result<Conversation> {
        let kv = session.model.new_kv_cache(context);
        Ok(Conversation {
            transcript: Transcript {
                system,
                messages: Vec::new(),
            },
            kv,
            cached_text: String::new(),
        })
    }

    /// Starts over with `transcript` (nothing is cached for it yet).
    pub fn replace<B: Backend>(&mut self, session: &mut Session<B>, transcript: Transcript) {
        self.transcript = transcript;
        self.forget_cache(&mut session.pages);
    }

    /// Tokens in the KV cache, and its capacity.
    pub fn context_used(&self) -> (usize, usize) {
        (self.kv.len(), self.kv.capacity())
    }

    fn forget_cache(&mut self, pages: &mut PagePool) {
        pages.truncate(&mut self.kv, 0);
        self.cached_text.clear();
    }

    fn messages(&self) -> Vec<Message> {
        let system = self.transcript.system.iter().map(|s| Message::new("system", s));
        system.chain(self.transcript.messages.iter().cloned()).collect()
    }

    /// Adds the user's message, generates the reply (streamed through `on_text`) and records it.
    pub fn reply<B: Backend>(
        &mut self,
        session: &mut Session<B>,
        user: &str,
        sampler: &mut Sampler,
        options: &GenerateOptions,
        on_text: impl FnMut(&str),
    ) -> Result<Turn> {
        let template = session
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::Template("the model has no chat template".into()))?;
        self.transcript.messages.push(Message::new("user", user));
        let mut dropped_turns = 0;
        let (text, new_tokens) = loop {
            let chat = template.render_chat(&self.messages(), true)?;
            let cached = !self.cached_text.is_empty() && chat.text().starts_with(self.cached_text.as_str());
            let new_tokens = if cached {
                session.tokenizer.encode_chat(&chat.tail(self.cached_text.len()))?
            } else {
                self.forget_cache(&mut session.pages);
                session.tokenizer.encode_chat(&chat)?
            };
            let text = chat.text().to_owned();
            // Saturating: `max_tokens` comes from a user and may be anything.
            let needed = (self.kv.len() + new_tokens.len()).saturating_add(options.max_tokens.max(1));
            // Drop the oldest exchange (never the system message, never the new message).
            if needed > self.kv.capacity() && self.transcript.messages.len() > 1 {
                let first_user = self
                    .transcript
                    .messages
                    .iter()
                    .position(|m| m.role == "user")
                    .unwrap_or(0);
                let end = self.transcript.messages[first_user + 1..]
                    .iter()
                    .position(|m| m.role == "user")
                    .map_or(self.transcript.messages.len() - 1, |i| first_user + 1 + i);
                self.transcript.messages.drain(..end.max(1));
                dropped_turns += 1;
                self.forget_cache(&mut session.pages);
                continue;
            }
            break (text, new_tokens);
        };
        let start_len = self.kv.len();
        let result = generate(session, &mut self.kv, &new_tokens, sampler, options, on_text);
        let generation = match result {
            Ok(g) => g,
            Err(e) => {
                self.transcript.messages.pop();
                if session.pages.truncate(&mut self.kv, start_len) < start_len {
                    self.forget_cache(&mut session.pages);
                }
                return Err(e);
            }
        };
        // The cache holds the prompt and, when the reply ended at an end-of-turn token, exactly
        // the reply's tokens. Otherwise it may hold tokens past the recorded text: keep only the
        // prompt, and the next turn runs the reply again.
        let prompt_len = start_len + new_tokens.len();
        if generation.stop_reason == StopReason::EndOfGeneration {
            self.cached_text = text + &generation.text;
        } else if session.pages.truncate(&mut self.kv, prompt_len) == prompt_len {
            self.cached_text = text;
        } else {
            self.forget_cache(&mut session.pages);
        }
        self.transcript
            .messages
            .push(Message::new("assistant", &generation.text));
        Ok(Turn {
            generation,
            prompt_tokens_run: new_tokens.len(),
            dropped_turns,
        })
    }
}
