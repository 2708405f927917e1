//! One sequence's output: its sampled tokens become the text it streams, and the reason it
//! ends. The one-sequence generation loop and the scheduler both drive it, token by token.

use crate::tokenizer::{TextStream, Tokenizer};
use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndOfGeneration,
    MaxTokens,
    StopString,
    /// One of the request's stop tokens.
    StopToken,
    /// The output's constraint is complete: nothing may follow.
    ConstraintComplete,
    ContextFull,
    /// The caller stopped it ([`OutputState::finish`]); the output never ends so by itself.
    Cancelled,
}

/// When an output ends without a stop string.
#[derive(Debug, Clone, Copy)]
pub struct OutputLimits {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Most tokens the context has room for; reaching it ends the output as
    /// [`StopReason::ContextFull`] (unless `max_tokens` is reached by the same token).
    pub context_room: usize,
    /// Keep going through end-of-generation tokens, as ordinary tokens (benchmarks).
    pub ignore_eos: bool,
}

/// What one token did to the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOutput {
    /// The token is part of the output: false only for the end-of-generation token that ends it.
    pub token_is_output: bool,
    /// Text that became certain with this token: possibly empty (a character or a possible stop
    /// string still incomplete), possibly more than the token's own.
    pub text: String,
    /// Set once the output has ended; nothing more is to be pushed.
    pub finished: Option<StopReason>,
}

/// The text held back when an output ends, and why it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub text: String,
    pub reason: StopReason,
}

/// Detokenizes a sequence's tokens, cuts its text before the first stop string, and decides
/// when it ends: an end-of-generation token, a stop token, a stop string, or a limit.
pub struct OutputState {
    stream: TextStream,
    stops: StopMatcher,
    /// Tokens that end the output like an end-of-generation token, left out of it too.
    stop_tokens: Vec<u32>,
    limits: OutputLimits,
    /// Tokens that joined the output.
    generated: usize,
}

impl OutputState {
    pub fn new(stop: Vec<String>, stop_tokens: Vec<u32>, limits: OutputLimits) -> Self {
        OutputState {
            stream: TextStream::default(),
            stops: StopMatcher::new(stop),
            stop_tokens,
            limits,
            generated: 0,
        }
    }

    /// Tokens the limits still allow; when it is 1, the next token ends the output whatever it is.
    pub fn remaining(&self) -> usize {
        self.limits
            .max_tokens
            .min(self.limits.context_room)
            .saturating_sub(self.generated)
    }

    /// Takes the next sampled token. When it ends the output (other than by a stop string) the
    /// held-back text comes with it, as from [`OutputState::finish`].
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<TokenOutput> {
        let end = if self.stop_tokens.contains(&token) {
            Some(StopReason::StopToken)
        } else if tokenizer.is_end_of_generation(token) && !self.limits.ignore_eos {
            Some(StopReason::EndOfGeneration)
        } else {
            None
        };
        if let Some(reason) = end {
            let ending = self.finish(tokenizer, reason)?;
            return Ok(TokenOutput {
                token_is_output: false,
                text: ending.text,
                finished: Some(ending.reason),
            });
        }
        self.generated += 1;
        let mut text = String::new();
        if let Some(piece) = self.stream.push(tokenizer, token)? {
            if self.stops.push(&piece, &mut text) {
                return Ok(TokenOutput {
                    token_is_output: true,
                    text,
                    finished: Some(StopReason::StopString),
                });
            }
        }
        let limit = if self.generated >= self.limits.max_tokens {
            Some(StopReason::MaxTokens)
        } else if self.generated >= self.limits.context_room {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        let finished = match limit {
            Some(reason) => {
                let ending = self.finish(tokenizer, reason)?;
                text.push_str(&ending.text);
                Some(ending.reason)
            }
            None => None,
        };
        Ok(TokenOutput {
            token_is_output: true,
            text,
            finished,
        })
    }

    /// Ends the output for `reason`, releasing the text held back for an incomplete character
    /// or a possible stop string. Should that text complete a stop string, it is cut there and
    /// the output ends as [`StopReason::StopString`] instead.
    pub fn finish(&mut self, tokenizer: &Tokenizer, reason: StopReason) -> Result<Ending> {
        let mut text = String::new();
        let mut reason = reason;
        if let Some(rest) = self.stream.finish(tokenizer)? {
            if self.stops.push(&rest, &mut text) {
                reason = StopReason::StopString;
            }
        }
        self.stops.flush(&mut text);
        Ok(Ending { text, reason })
    }

    /// Ends the output with the token `step` came from, unless that token ended it already.
    pub fn end_with(&mut self, step: &mut TokenOutput, tokenizer: &Tokenizer, reason: StopReason) -> Result<()> {
        if step.finished.is_none() {
            let ending = self.finish(tokenizer, reason)?;
            step.text.push_str(&ending.text);
            step.finished = Some(ending.reason);
        }
        Ok(())
    }

    /// All the text emitted so far.
    pub fn text(&self) -> &str {
        &self.stops.text
    }

    pub fn into_text(self) -> String {
        self.stops.text
    }
}

/// Accumulates the generated text, emitting only what cannot be the start of a stop string.
struct StopMatcher {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

impl StopMatcher {
    fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds text, appending to `out` what became certain; returns true when a stop string has
    /// appeared (the text is cut before it).
    fn push(&mut self, piece: &str, out: &mut String) -> bool {
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
            self.flush(out);
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
            out.push_str(&self.text[self.emitted..ready]);
            self.emitted = ready;
        }
        false
    }

    /// Appends to `out` everything not yet emitted.
    fn flush(&mut self, out: &mut String) {
        out.push_str(&self.text[self.emitted..]);
        self.emitted = self.text.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::gguf::{GgufFile, Value};
    use crate::format::gguf_writer::GgufWriter;
    use std::sync::OnceLock;

    const END_OF_GENERATION: u32 = 2;

    /// A SentencePiece vocabulary: control tokens, the 256 byte tokens, and a few pieces.
    fn tokenizer() -> &'static Tokenizer {
        static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| {
            let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
            let mut types = vec![2, 3, 3];
            tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
            types.extend([6; 256]);
            for piece in ["Hello", "▁there", "User", ":", "▁more"] {
                tokens.push(piece.into());
                types.push(1);
            }
            let mut w = GgufWriter::default();
            w.set("tokenizer.ggml.model", Value::String("llama".into()));
            w.set("tokenizer.ggml.add_space_prefix", Value::Bool(false));
            w.set("tokenizer.ggml.eos_token_id", Value::U32(END_OF_GENERATION));
            w.set(
                "tokenizer.ggml.scores",
                Value::Array(vec![Value::F32(0.0); tokens.len()]),
            );
            w.set(
                "tokenizer.ggml.token_type",
                Value::Array(types.into_iter().map(Value::I32).collect()),
            );
            w.set(
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            );
            let path = std::env::temp_dir().join(format!("axiom-output-test-{}.gguf", std::process::id()));
            w.write(&path).unwrap();
            let file = GgufFile::open(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            Tokenizer::from_gguf(&file).unwrap()
        })
    }

    fn id(piece: &str) -> u32 {
        let tok = tokenizer();
        (0..tok.vocab_size() as u32)
            .find(|&i| tok.token_text(i) == Some(piece))
            .unwrap()
    }

    fn limits(max_tokens: usize) -> OutputLimits {
        OutputLimits {
            max_tokens,
            context_room: usize::MAX,
            ignore_eos: false,
        }
    }

    /// Pushes the pieces' tokens in turn: each token's text and the reason the output ended.
    fn run(output: &mut OutputState, pieces: &[&str]) -> (Vec<String>, Option<StopReason>) {
        let mut texts = Vec::new();
        for piece in pieces {
            let step = output.push(tokenizer(), id(piece)).unwrap();
            texts.push(step.text);
            if step.finished.is_some() {
                return (texts, step.finished);
            }
        }
        (texts, None)
    }

    fn stops(stops: &[&str]) -> Vec<String> {
        stops.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stop_string_split_across_tokens_is_held_back_then_never_emitted() {
        let mut output = OutputState::new(stops(&["\n\nUser:"]), Vec::new(), limits(100));
        let pieces = ["Hello", "▁there", "<0x0A>", "<0x0A>", "User", ":", "▁more"];
        let (texts, finished) = run(&mut output, &pieces);
        assert_eq!(texts, ["Hello", " there", "", "", "", ""]);
        assert_eq!(finished, Some(StopReason::StopString));
        assert_eq!(output.text(), "Hello there");
    }

    #[test]
    fn held_back_text_is_released_when_the_stop_string_does_not_complete() {
        let mut output = OutputState::new(stops(&["\n\nUser:"]), Vec::new(), limits(100));
        let (texts, finished) = run(&mut output, &["Hello", "<0x0A>", "<0x0A>", "▁more"]);
        assert_eq!(texts, ["Hello", "", "", "\n\n more"]);
        assert_eq!(finished, None);
    }

    #[test]
    fn stop_string_at_the_very_first_token_emits_nothing() {
        let mut output = OutputState::new(stops(&["Hello"]), Vec::new(), limits(100));
        let step = output.push(tokenizer(), id("Hello")).unwrap();
        assert_eq!(
            step,
            TokenOutput {
                token_is_output: true,
                text: String::new(),
                finished: Some(StopReason::StopString),
            }
        );
        assert_eq!(output.into_text(), "");
    }

    #[test]
    fn end_of_generation_ends_without_joining_the_output_and_flushes() {
        let mut output = OutputState::new(stops(&["Hello!"]), Vec::new(), limits(100));
        assert_eq!(output.push(tokenizer(), id("Hello")).unwrap().text, "");
        let step = output.push(tokenizer(), END_OF_GENERATION).unwrap();
        assert_eq!(
            step,
            TokenOutput {
                token_is_output: false,
                text: "Hello".into(),
                finished: Some(StopReason::EndOfGeneration),
            }
        );
        assert_eq!(output.remaining(), 99);
    }

    #[test]
    fn ignore_eos_takes_end_of_generation_as_an_ordinary_token() {
        let limits = OutputLimits {
            ignore_eos: true,
            ..limits(100)
        };
        let mut output = OutputState::new(Vec::new(), Vec::new(), limits);
        let step = output.push(tokenizer(), END_OF_GENERATION).unwrap();
        assert!(step.token_is_output);
        assert_eq!(step.finished, None);
        assert_eq!(output.remaining(), 99);
    }

    #[test]
    fn max_tokens_ends_on_the_last_token_with_the_held_back_text() {
        let mut unlimited = OutputState::new(stops(&["re!"]), Vec::new(), limits(100));
        assert_eq!(run(&mut unlimited, &["Hello", "▁there"]).0, ["Hello", " the"]);
        let mut output = OutputState::new(stops(&["re!"]), Vec::new(), limits(2));
        assert_eq!(output.remaining(), 2);
        let (texts, finished) = run(&mut output, &["Hello", "▁there"]);
        assert_eq!(texts, ["Hello", " there"]);
        assert_eq!(finished, Some(StopReason::MaxTokens));
        assert_eq!(output.remaining(), 0);
    }

    #[test]
    fn context_room_ends_as_context_full_unless_max_tokens_ends_there_too() {
        let room = |max_tokens, context_room| {
            let limits = OutputLimits {
                max_tokens,
                context_room,
                ignore_eos: false,
            };
            let mut output = OutputState::new(Vec::new(), Vec::new(), limits);
            run(&mut output, &["Hello", "▁there", "▁more"]).1
        };
        assert_eq!(room(3, 2), Some(StopReason::ContextFull));
        assert_eq!(room(2, 2), Some(StopReason::MaxTokens));
        assert_eq!(room(2, 3), Some(StopReason::MaxTokens));
    }

    #[test]
    fn multi_byte_character_split_across_tokens_is_emitted_whole() {
        let mut output = OutputState::new(Vec::new(), Vec::new(), limits(100));
        let (texts, finished) = run(&mut output, &["Hello", "<0xC3>", "<0xA9>", "▁there"]);
        assert_eq!(texts, ["Hello", "", "é", " there"]);
        assert_eq!(finished, None);
        assert_eq!(output.text(), "Helloé there");
    }

    #[test]
    fn finish_flushes_text_held_for_a_possible_stop_string() {
        let mut output = OutputState::new(stops(&[" there!"]), Vec::new(), limits(100));
        let (texts, _) = run(&mut output, &["Hello", "▁there"]);
        assert_eq!(texts, ["Hello", ""]);
        let ending = output.finish(tokenizer(), StopReason::Cancelled).unwrap();
        assert_eq!(
            ending,
            Ending {
                text: " there".into(),
                reason: StopReason::Cancelled,
            }
        );
        assert_eq!(output.text(), "Hello there");
    }
}
