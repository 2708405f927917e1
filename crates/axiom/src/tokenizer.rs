//! Tokenizers built from GGUF metadata on the `tokenizers` crate.
//!
//! The GGUF vocabulary is turned into the `tokenizer.json` description Hugging Face would use
//! for the same model, and loaded by `tokenizers`: byte-level BPE (`gpt2`) with the
//! pre-tokenizer that `tokenizer.ggml.pre` names, or SentencePiece-style BPE (`llama`) with
//! merges derived from the token scores.

use crate::chat::{ContentSpans, RenderedChat};
use crate::format::gguf::{GgufFile, Value};
use crate::{Error, Result};
use serde_json::{json, Value as Json};
use std::collections::HashSet;
use std::ops::Range;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizerWrapper};

/// GGUF token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Splitting regex of Llama 3 (`llama-bpe`).
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Splitting regex of Qwen2: as Llama 3 but single digits.
pub const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Texts of control tokens that end a turn, besides the declared EOS (as llama.cpp infers them).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|eom_id|>",
];

/// Normalizers can shrink text before the vocabulary sees it: Unicode compatibility forms and
/// case mapping turn one character into a shorter one, at most 4 bytes into 1 (NFKC "𝐀" to "A").
const NORMALIZER_SHRINK: usize = 4;

pub struct Tokenizer {
    /// Reads special-token text such as `<|im_start|>` as the special token.
    parsing: tokenizers::Tokenizer,
    /// The same pipeline reading special-token text as plain text. A second copy rather than one
    /// whose flag is flipped per call, so that encoding (a long prompt may take seconds) never
    /// holds a lock the decoding of running streams waits on.
    plain: tokenizers::Tokenizer,
    /// `plain` for text that does not start the input, where the tokenizer would not prepend
    /// SentencePiece's "▁" (`prepend_scheme: first`); `None` when that changes nothing.
    plain_continued: Option<tokenizers::Tokenizer>,
    /// The most input bytes one token can stand for, `None` when unbounded.
    max_token_bytes: Option<usize>,
    tokens: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    end_of_generation: HashSet<u32>,
    /// SentencePiece's dummy prefix (GGUF `llama` with `add_space_prefix`): "▁" goes before each
    /// run of text between added tokens, even one that starts with a space, as llama.cpp and
    /// Llama 2's own tokenizer give it; `Metaspace` would skip it there and after added tokens.
    dummy_prefix: bool,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let model = file.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
        let tokens: Vec<String> = string_array(file, "tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let token_types: Vec<i64> = match file.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) if a.len() == n => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            Some(a) => return Err(Error::Tokenizer(format!("{} token types for {n} tokens", a.len()))),
            None => vec![1; n],
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key).and_then(Value::as_u64) {
                Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                Some(i) => Err(Error::Tokenizer(format!("{key} {i} is outside the vocabulary of {n}"))),
                None => Ok(None),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let flag = |key: &str| file.get(key).and_then(Value::as_bool);

        let mut space_prefix = false;
        let description = match model {
            "gpt2" => {
                let pre = file
                    .get("tokenizer.ggml.pre")
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let merges = string_array(file, "tokenizer.ggml.merges")?;
                byte_level_bpe(&tokens, &merges, pre)?
            }
            "llama" => {
                let scores: Vec<f32> = match file.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                    Some(a) if a.len() == n => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
                    _ => {
                        return Err(Error::Tokenizer(
                            "SentencePiece vocabulary without one score per token".into(),
                        ))
                    }
                };
                let unk = id("tokenizer.ggml.unknown_token_id")?.unwrap_or(0);
                space_prefix = flag("tokenizer.ggml.add_space_prefix").unwrap_or(true);
                sentencepiece_bpe(&tokens, &scores, &token_types, unk, space_prefix)
            }
            other => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer model {other:?} is not supported (gpt2, llama)"
                )))
            }
        };
        let added: Vec<Json> = tokens
            .iter()
            .zip(&token_types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(i, (text, &ty))| {
                json!({"id": i, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": ty == TOKEN_TYPE_CONTROL})
            })
            .collect();
        let mut description = description;
        description["added_tokens"] = Json::Array(added);
        let inner: tokenizers::Tokenizer = description.to_string().parse().map_err(tok_err)?;
        drop(description);

        let mut end_of_generation: HashSet<u32> = eos.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            end_of_generation.extend(id(key)?);
        }
        for (i, (text, &ty)) in tokens.iter().zip(&token_types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL && END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
                end_of_generation.insert(i as u32);
            }
        }
        let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(model == "llama");
        let mut tokenizer = Tokenizer::new(inner, tokens, bos, eos, add_bos, end_of_generation);
        tokenizer.dummy_prefix = space_prefix;
        Ok(tokenizer)
    }

    /// From a Hugging Face model directory: `tokenizer.json`, with BOS/EOS from
    /// `tokenizer_config.json` and the end-of-generation ids of `generation_config.json`.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let read_json = |name: &str| -> serde_json::Value {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default()
        };
        let config = read_json("tokenizer_config.json");
        let generation = read_json("generation_config.json");
        let vocab = inner.get_vocab(true);
        let n = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let mut tokens = vec![String::new(); n];
        for (text, &id) in &vocab {
            tokens[id as usize] = text.clone();
        }
        // A token given as a string or as {"content": ...}.
        let token_id = |v: &serde_json::Value| {
            let text = v.as_str().or_else(|| v["content"].as_str())?;
            inner.token_to_id(text)
        };
        let bos = token_id(&config["bos_token"]);
        let eos = token_id(&config["eos_token"]);
        // BOS is added when the tokenizer's own post-processor would add it.
        let with = inner.encode_fast("a", true).map_err(tok_err)?;
        let without = inner.encode_fast("a", false).map_err(tok_err)?;
        let added_bos = (with.len() > without.len()).then(|| with.get_ids()[0]);
        let add_bos = config["add_bos_token"].as_bool().unwrap_or(added_bos.is_some());
        let bos = added_bos.or(bos);
        let mut end_of_generation: HashSet<u32> = eos.into_iter().collect();
        match &generation["eos_token_id"] {
            serde_json::Value::Array(ids) => {
                end_of_generation.extend(ids.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
            }
            v => end_of_generation.extend(v.as_u64().map(|v| v as u32)),
        }
        for added in inner.get_added_tokens_decoder().values().filter(|t| t.special) {
            if END_OF_GENERATION_TEXTS.contains(&added.content.as_str()) {
                end_of_generation.extend(inner.token_to_id(&added.content));
            }
        }
        end_of_generation.retain(|&id| (id as usize) < n);
        Ok(Tokenizer::new(inner, tokens, bos, eos, add_bos, end_of_generation))
    }

    fn new(
        mut parsing: tokenizers::Tokenizer,
        tokens: Vec<String>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
        end_of_generation: HashSet<u32>,
    ) -> Tokenizer {
        parsing.set_encode_special_tokens(false);
        let mut plain = parsing.clone();
        plain.set_encode_special_tokens(true);
        let plain_continued = without_first_prefix(&plain);
        let max_token_bytes = max_token_bytes(&parsing);
        Tokenizer {
            parsing,
            plain,
            plain_continued,
            max_token_bytes,
            tokens,
            bos,
            eos,
            add_bos,
            end_of_generation,
            dummy_prefix: false,
        }
    }

    /// Ids of `text` through `tk`, each run between added tokens with its own dummy prefix.
    fn encode_with(&self, tk: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
        if !self.dummy_prefix {
            return Ok(tk.encode_fast(text, false).map_err(tok_err)?.get_ids().to_vec());
        }
        let splits = tk
            .get_added_vocabulary()
            .extract_and_normalize(tk.get_normalizer(), text);
        let mut ids = Vec::new();
        for (_, (start, end), tokens) in splits.get_splits(OffsetReferential::Original, OffsetType::Byte) {
            match tokens {
                Some(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                None => {
                    let run = format!(" {}", &text[start..end]);
                    ids.extend_from_slice(tk.encode_fast(run.as_str(), false).map_err(tok_err)?.get_ids());
                }
            }
        }
        Ok(ids)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text`; `parse_special` matches control-token text such as `<|im_start|>`.
    /// Adds BOS when the model asks for it and `add_bos` is set.
    pub fn encode(&self, text: &str, parse_special: bool, add_bos: bool) -> Result<Vec<u32>> {
        let tk = if parse_special { &self.parsing } else { &self.plain };
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode_with(tk, text)?);
        Ok(ids)
    }

    /// Text of `ids`; control tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.parsing.decode(ids, skip_special).map_err(tok_err)
    }

    /// A lower bound on the number of tokens any text of `bytes` bytes encodes to (either mode),
    /// to refuse a prompt too long for the context without tokenizing it. Characters the
    /// vocabulary has no token for are dropped by the tokenizer (as by llama.cpp) and are not
    /// covered: text made of them encodes to fewer tokens.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        self.max_token_bytes.map_or(0, |most| bytes.div_ceil(most))
    }

    /// Token ids of a rendered chat prompt: the template's control tokens are read as such, the
    /// messages' content as plain text, so that `<|im_end|>` typed in a message cannot end its
    /// turn. Prompts whose content holds no special-token text get exactly `encode(text, true,
    /// false)`; BOS is never added, as templates write it themselves.
    pub fn encode_chat(&self, chat: &RenderedChat) -> Result<Vec<u32>> {
        let text = chat.text();
        let content = match &chat.content {
            ContentSpans::Placed(spans) => spans,
            ContentSpans::Unplaced(contents) => {
                if contents.iter().any(|c| !self.special_matches(c).is_empty()) {
                    return Err(Error::Template(
                        "a message holds special-token text, and the chat template changes message \
                         content in a way that hides where it is in the prompt"
                            .into(),
                    ));
                }
                return self.encode(text, true, false);
            }
        };
        let mut kept = Vec::new();
        let mut forged = false;
        for (range, id) in self.special_matches(text) {
            // A token told to strip whitespace may take some from the content beside it.
            let matched = &text[range.clone()];
            let start = range.start + matched.len() - matched.trim_start().len();
            let core = start..start + matched.trim().len();
            let in_content: usize = content.iter().map(|c| overlap(c, &core)).sum();
            if in_content == 0 {
                kept.push((range, id));
            } else if in_content == core.len() {
                forged = true;
            } else {
                return Err(Error::Template(format!(
                    "message content runs into the chat template's special token {:?}",
                    &text[core]
                )));
            }
        }
        if !forged {
            return self.encode(text, true, false);
        }
        // What lies between the template's own special tokens is encoded as plain text, as the
        // tokenizer itself encodes the text between the special tokens it finds.
        let mut ids = Vec::new();
        let mut start = 0;
        for (range, id) in kept {
            ids.extend(self.encode_run(&text[start..range.start], start == 0)?);
            ids.push(id);
            start = range.end;
        }
        ids.extend(self.encode_run(&text[start..], start == 0)?);
        Ok(ids)
    }

    /// The first special token's text that `text` holds, if any: text a template writes outside
    /// message content (tool definitions, tool calls) must hold none, or it could forge a turn.
    pub fn special_token_in<'a>(&self, text: &'a str) -> Option<&'a str> {
        self.special_matches(text)
            .first()
            .map(|(range, _)| &text[range.clone()])
    }

    /// Where `parsing` finds special tokens in `text`, and their ids.
    fn special_matches(&self, text: &str) -> Vec<(Range<usize>, u32)> {
        let added = self.parsing.get_added_vocabulary();
        let specials = added.get_added_tokens_decoder();
        let splits = added.extract_and_normalize(self.parsing.get_normalizer(), text);
        splits
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, (start, end), tokens)| {
                let id = tokens.as_ref()?.first()?.id;
                specials.get(&id)?.special.then_some((start..end, id))
            })
            .collect()
    }

    /// Plain-text ids of part of an input, `first` when it starts the input.
    fn encode_run(&self, text: &str, first: bool) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        match &self.plain_continued {
            Some(continued) if !first => self.encode_with(continued, text),
            _ => self.encode_with(&self.plain, text),
        }
    }

    /// The vocabulary entry of a token (e.g. "Ġworld").
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    pub fn end_of_generation_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.end_of_generation.iter().copied()
    }

    /// Ids of the end-of-generation tokens, in increasing order.
    pub fn end_of_generation_sorted(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.end_of_generation.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The pipeline that encodes plain text continuing an output (no SentencePiece space
    /// prefix), for use apart from this tokenizer.
    pub fn continuation_encoder(&self) -> tokenizers::Tokenizer {
        self.plain_continued.as_ref().unwrap_or(&self.plain).clone()
    }

    /// The bytes each token stands for in the text, by id: the vocabulary entry read through
    /// GPT-2's byte map (byte-level BPE) or with "▁" as a space and "<0xNN>" as byte NN
    /// (SentencePiece); added tokens are their literal text, and special tokens (control tokens
    /// and the unknown token) are [`SPECIAL_TOKEN_MARKER`] followed by their text, so that no
    /// text can spell them.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let style = TokenStyle::of(&self.parsing)?;
        let added = self.parsing.get_added_tokens_decoder();
        let unknown = match self.parsing.get_model() {
            tokenizers::ModelWrapper::BPE(bpe) => bpe.get_unk_token().clone(),
            _ => None,
        };
        Ok(self
            .tokens
            .iter()
            .enumerate()
            .map(|(id, text)| {
                let special = |text: &str| [&[SPECIAL_TOKEN_MARKER], text.as_bytes()].concat();
                match added.get(&(id as u32)) {
                    Some(token) if token.special => special(&token.content),
                    Some(token) => token.content.as_bytes().to_vec(),
                    None if unknown.as_deref() == Some(text.as_str()) => special(text),
                    None => style.bytes(text),
                }
            })
            .collect())
    }

    /// Name of the tokenizer model for `axiom info`.
    pub fn describe(&self) -> String {
        let kind = match self.parsing.get_model() {
            tokenizers::ModelWrapper::BPE(_) => "BPE",
            _ => "other",
        };
        format!(
            "{kind}, {} tokens, {} end-of-generation ids",
            self.tokens.len(),
            self.end_of_generation.len()
        )
    }
}

/// Marks a special token's bytes: never valid UTF-8, so no text can spell one (toktrie's convention).
pub const SPECIAL_TOKEN_MARKER: u8 = 0xff;

/// How a vocabulary entry spells the bytes its token stands for.
enum TokenStyle {
    /// GPT-2's byte-level BPE: each byte is one printable character; this maps them back.
    ByteLevel(std::collections::HashMap<char, u8>),
    /// SentencePiece: "▁" for a space, "<0xNN>" for a byte, other text as itself.
    SentencePiece,
}

impl TokenStyle {
    /// From the tokenizer's decoder, which is what turns entries into text.
    fn of(tk: &tokenizers::Tokenizer) -> Result<TokenStyle> {
        use tokenizers::DecoderWrapper as D;
        match tk.get_decoder() {
            Some(D::ByteLevel(_)) => Ok(TokenStyle::ByteLevel(gpt2_byte_map())),
            Some(D::Metaspace(_)) => Ok(TokenStyle::SentencePiece),
            Some(D::Sequence(seq)) if seq.get_decoders().iter().any(|d| matches!(d, D::ByteFallback(_))) => {
                Ok(TokenStyle::SentencePiece)
            }
            _ => Err(Error::Tokenizer(
                "the tokenizer's decoder is neither byte-level BPE nor SentencePiece-style, so the \
                 bytes of its tokens are unknown"
                    .into(),
            )),
        }
    }

    fn bytes(&self, entry: &str) -> Vec<u8> {
        match self {
            // An entry with a character outside the map cannot come out of the byte-level
            // pre-tokenizer; its own UTF-8 is the best reading of it.
            TokenStyle::ByteLevel(map) => {
                let mapped: Option<Vec<u8>> = entry.chars().map(|c| map.get(&c).copied()).collect();
                mapped.unwrap_or_else(|| entry.as_bytes().to_vec())
            }
            TokenStyle::SentencePiece => match byte_fallback_entry(entry) {
                Some(byte) => vec![byte],
                None => entry.replace('▁', " ").into_bytes(),
            },
        }
    }
}

/// The byte of a "<0xNN>" entry.
fn byte_fallback_entry(entry: &str) -> Option<u8> {
    let hex = entry.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves, the
/// others for the characters from U+0100 on, in byte order.
fn gpt2_byte_map() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (c, b)
            }
        })
        .collect()
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> usize {
    a.end.min(b.end).saturating_sub(a.start.max(b.start))
}

/// `tk` with a Metaspace pre-tokenizer that prepends "▁" to the start of the input changed to
/// never prepend it; `None` when `tk` has none.
fn without_first_prefix(tk: &tokenizers::Tokenizer) -> Option<tokenizers::Tokenizer> {
    fn never(pre: &mut PreTokenizerWrapper) -> bool {
        match pre {
            PreTokenizerWrapper::Metaspace(m) if m.get_prepend_scheme() == PrependScheme::First => {
                m.set_prepend_scheme(PrependScheme::Never);
                true
            }
            PreTokenizerWrapper::Sequence(seq) => {
                // Every one in the sequence, not only the first.
                seq.as_mut()
                    .iter_mut()
                    .map(never)
                    .fold(false, |any, changed| any | changed)
            }
            _ => false,
        }
    }
    let mut pre = tk.get_pre_tokenizer()?.clone();
    never(&mut pre).then(|| {
        let mut continued = tk.clone();
        continued.with_pre_tokenizer(Some(pre));
        continued
    })
}

/// The most input bytes one token can stand for: the longest vocabulary entry in UTF-8, since
/// no entry is shorter than what it stands for (a byte-level BPE character stands for one byte
/// and is 1 or 2 bytes long, SentencePiece's 3-byte "▁" for one space, "<0x41>" for one byte),
/// times what a normalizer may shrink the text by. Unbounded when an added token strips the
/// whitespace beside it, however long.
fn max_token_bytes(tk: &tokenizers::Tokenizer) -> Option<usize> {
    let added = tk.get_added_vocabulary().get_added_tokens_decoder();
    if added.values().any(|t| t.lstrip || t.rstrip) {
        return None;
    }
    let longest = tk.get_vocab(true).keys().map(String::len).max()?;
    let shrink = if tk.get_normalizer().is_some() {
        NORMALIZER_SHRINK
    } else {
        1
    };
    Some(longest * shrink)
}

fn string_array(file: &GgufFile, key: &str) -> Result<Vec<String>> {
    let array = file
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Tokenizer(format!("missing {key}")))?;
    array
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| Error::Tokenizer(format!("{key} holds a non-string")))
        })
        .collect()
}

fn vocab_json(tokens: &[String]) -> Json {
    // Later duplicates must not shadow earlier ids, as in llama.cpp's token-to-id map.
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(json!(i));
    }
    Json::Object(vocab)
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// Byte-level BPE as GPT-2 and its descendants use it.
fn byte_level_bpe(tokens: &[String], merges: &[String], pre: &str) -> Result<Json> {
    let (pre_tokenizer, ignore_merges) = match pre {
        "default" | "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "roberta-bpe" => (byte_level(true), false),
        "smollm" | "starcoder" | "refact" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        "llama-bpe" | "llama3" | "smaug-bpe" | "falcon3" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]}),
            true,
        ),
        "qwen2" | "deepseek-r1-qwen" => (
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
            false,
        ),
        other => {
            return Err(Error::Tokenizer(format!(
                "BPE pre-tokenizer {other:?} is not supported"
            )))
        }
    };
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<_>>()?;
    Ok(json!({
        "version": "1.0",
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab_json(tokens), "merges": merges},
    }))
}

/// SentencePiece BPE (Llama 2, Mistral): merge the adjacent pair whose joined piece scores highest.
/// That is BPE whose merges are every split of a vocabulary piece into two vocabulary pieces,
/// ranked by the joined piece's score.
fn sentencepiece_bpe(tokens: &[String], scores: &[f32], types: &[i64], unk: u32, space_prefix: bool) -> Json {
    let merges: Vec<Json> = sentencepiece_merges(tokens, scores, types)
        .into_iter()
        .map(|(l, r)| json!([l, r]))
        .collect();
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "normalizer": null,
        // The dummy prefix is `Tokenizer::encode_with`'s: per run of text, as llama.cpp gives it.
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": tokens.get(unk as usize), "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab_json(tokens), "merges": merges},
    })
}

/// The merges a SentencePiece vocabulary implies: every split of a normal piece (type 1) into two
/// pieces of the vocabulary, the highest-scoring piece's first, ties broken by the halves' ids,
/// as transformers' SentencePiece converter orders them.
pub fn sentencepiece_merges<'t>(tokens: &'t [String], scores: &[f32], types: &[i64]) -> Vec<(&'t str, &'t str)> {
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().rev().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if types[i] != 1 {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (index.get(left), index.get(right)) {
                merges.push((scores[i], l, r, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges.into_iter().map(|m| (m.3, m.4)).collect()
}

/// Turns a stream of token ids into text pieces that never split a UTF-8 character.
///
/// Decodes a short window of recent tokens and emits what it adds beyond the window's previous
/// text, holding back while the text ends in an incomplete character.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl TextStream {
    /// Adds a token; returns the text that is now complete, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let after = tokenizer.decode(&self.ids[self.prefix..], true)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let new = after.get(before.len()..).map(str::to_owned).unwrap_or_default();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(Some(new));
        }
        Ok(None)
    }

    /// What is still held back at the end of generation.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let after = tokenizer.decode(&self.ids[self.prefix..], true)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(after.get(before.len()..).filter(|s| !s.is_empty()).map(str::to_owned))
    }
}
