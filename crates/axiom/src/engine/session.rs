//! Everything needed to turn text into text with one model: the network on a backend, its
//! tokenizer and its chat template, loaded together from one file.

use crate::backend::Backend;
use crate::chat::{ChatTemplate, Message};
use crate::format::gguf::{GgufFile, Value};
use crate::model::llama::LoadOptions;
use crate::model::Llama;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::path::Path;

pub struct Session<B: Backend> {
    pub model: Llama<B>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub info: ModelInfo,
}

/// Facts about the loaded file, for summaries and benchmarks.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// e.g. "llama 135M Q4_1".
    pub description: String,
    pub file_bytes: usize,
    pub parameters: usize,
    /// Weight bytes one decode step reads: every matrix, the LM head included.
    pub weight_bytes_per_token: usize,
}

impl ModelInfo {
    fn from_gguf(file: &GgufFile, architecture: &str) -> ModelInfo {
        let parameters: usize = file.tensors.iter().map(|t| t.n_elements()).sum();
        let tied = file.tensor("output.weight").is_none();
        let weight_bytes_per_token = file
            .tensors
            .iter()
            .filter(|t| t.dims.len() == 2 && (tied || t.name != "token_embd.weight"))
            .map(|t| t.size_bytes)
            .sum();
        let size = file
            .get("general.size_label")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| {
                let p = parameters as f64;
                if p >= 1e9 {
                    format!("{:.1}B", p / 1e9)
                } else {
                    format!("{:.0}M", p / 1e6)
                }
            });
        // The type of most weight bytes names the quantization, as llama.cpp's file types do.
        let mut by_type: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for t in file.tensors.iter().filter(|t| t.dims.len() == 2) {
            *by_type.entry(t.ty.to_string()).or_default() += t.size_bytes;
        }
        let ty = by_type
            .into_iter()
            .max_by_key(|(_, bytes)| *bytes)
            .map(|(t, _)| t)
            .unwrap_or_default();
        ModelInfo {
            description: format!("{architecture} {size} {ty}"),
            file_bytes: file.file_size(),
            parameters,
            weight_bytes_per_token,
        }
    }
}

impl<B: Backend> Session<B> {
    pub fn load(path: &Path, backend: B, options: LoadOptions) -> Result<Session<B>> {
        let file = GgufFile::open(path)?;
        Self::from_gguf(&file, backend, options)
    }

    pub fn from_gguf(file: &GgufFile, backend: B, options: LoadOptions) -> Result<Session<B>> {
        let tokenizer = Tokenizer::from_gguf(file)?;
        let model = Llama::from_gguf(file, backend, options)?;
        if tokenizer.vocab_size() > model.config.vocab_size {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model only {} embeddings",
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        let token_string = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
        let chat_template = match file.get("tokenizer.chat_template").and_then(Value::as_str) {
            Some(source) => Some(ChatTemplate::new(
                source,
                &token_string(tokenizer.bos),
                &token_string(tokenizer.eos),
            )?),
            None => None,
        };
        let info = ModelInfo::from_gguf(file, &model.config.architecture);
        Ok(Session {
            model,
            tokenizer,
            chat_template,
            info,
        })
    }

    /// Token ids for a raw prompt (BOS added if the model wants it, special-token text parsed).
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, true, true)
    }

    /// Token ids for a conversation rendered with the model's chat template and an open
    /// assistant turn. The template supplies BOS itself, as in transformers' `apply_chat_template`.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::Template("the model has no chat template".into()))?;
        let text = template.render(messages, true)?;
        self.tokenizer.encode(&text, true, false)
    }
}
