//! The engine's tokenizer as llguidance sees it: a trie of every token's bytes
//! ([`Tokenizer::token_bytes`]), and tokenization of byte strings by the engine's own tokenizer.

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

struct AxiomTokEnv {
    trie: TokTrie,
    /// [`Tokenizer::continuation_encoder`].
    encoder: tokenizers::Tokenizer,
}

impl TokenizerEnv for AxiomTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text continuing an output, tokenized as the tokenizer would; bytes past the last whole
    /// UTF-8 character (or text the tokenizer fails on) token by token from the trie.
    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        let valid = match std::str::from_utf8(bytes) {
            Ok(_) => bytes.len(),
            Err(e) => e.valid_up_to(),
        };
        let text = String::from_utf8_lossy(&bytes[..valid]);
        let mut ids = match self.encoder.encode_fast(text.as_ref(), false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(_) => return self.trie.greedy_tokenize(bytes),
        };
        ids.extend(self.trie.greedy_tokenize(&bytes[valid..]));
        ids
    }
}

/// The environment llguidance compiles constraints against; every end-of-generation token ends
/// the output where the grammar may end.
pub fn tok_env(tokenizer: &Tokenizer) -> Result<TokEnv> {
    let words = tokenizer.token_bytes()?;
    let end_of_generation = tokenizer.end_of_generation_sorted();
    let eos = tokenizer
        .eos
        .or_else(|| end_of_generation.first().copied())
        .ok_or_else(|| {
            Error::Tokenizer("the tokenizer has no end-of-generation token to end a constrained output".into())
        })?;
    let info = TokRxInfo::new(words.len() as u32, eos);
    let mut ends = vec![eos];
    ends.extend(end_of_generation.iter().filter(|&&id| id != eos));
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&ends);
    Ok(Arc::new(AxiomTokEnv {
        trie,
        encoder: tokenizer.continuation_encoder(),
    }))
}
