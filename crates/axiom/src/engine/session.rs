//! Everything needed to turn text into text with one model: the network on a backend, its
//! tokenizer and its chat template, loaded together from a GGUF file or a model directory.

use crate::backend::Backend;
use crate::chat::{ChatTemplate, Message};
use crate::format::gguf::{GgufFile, Value};
use crate::format::safetensors::SafetensorsModel;
use crate::model::files::Container;
use crate::model::llama::LoadOptions;
use crate::model::weights::TensorSource;
use crate::model::{KvCache, Llama, LogitRows, ModelConfig, ModelFiles, PagePool};
use crate::parallel::Rank;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::path::Path;

pub struct Session<B: Backend> {
    pub model: Llama<B>,
    /// The pages of the model's KV cache, which the engine gives each sequence.
    pub pages: PagePool,
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
    /// Weight bytes one decode step of one token reads: every matrix, the LM head included, and
    /// of a mixture's experts only the share a token runs (`used / count` of them).
    pub weight_bytes_per_token: usize,
}

impl ModelInfo {
    fn new(source: &dyn TensorSource, config: &ModelConfig, size_label: Option<&str>, file_bytes: usize) -> ModelInfo {
        let architecture = &config.architecture;
        let tensors = source.all();
        let parameters: usize = tensors.iter().map(|(_, dims, _)| dims.iter().product::<usize>()).sum();
        // Experts stacked in one tensor (GGUF) count as matrices.
        let matrices = || tensors.iter().filter(|(_, dims, _)| dims.len() >= 2);
        // A decode step reads every matrix once, except an embedding that is not also the LM head,
        // and of the experts, the ones each token chose.
        let untied_embedding = match (source.tensor("output.weight"), source.tensor("token_embd.weight")) {
            (Some(_), Some(e)) => e.bytes.len(),
            _ => 0,
        };
        let is_expert = |name: &str| name.contains("_exps.") || name.contains(".experts.");
        let weight_bytes_per_token = source
            .stored_names()
            .into_iter()
            .zip(&tensors)
            .filter(|(_, (_, dims, _))| dims.len() >= 2)
            .map(|(name, &(_, _, bytes))| match &config.experts {
                Some(e) if is_expert(name) => bytes * e.used / e.count,
                _ => bytes,
            })
            .sum::<usize>()
            - untied_embedding;
        let size = size_label.map(str::to_owned).unwrap_or_else(|| {
            let p = parameters as f64;
            match p {
                p if p >= 1e9 => format!("{:.1}B", p / 1e9),
                p if p >= 1e6 => format!("{:.0}M", p / 1e6),
                p => format!("{:.0}K", p / 1e3),
            }
        });
        // The type of most weight bytes names the quantization, as llama.cpp's file types do.
        let mut by_type: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (ty, _, bytes) in matrices() {
            *by_type.entry(ty.to_string()).or_default() += bytes;
        }
        let ty = by_type
            .into_iter()
            .max_by_key(|(_, bytes)| *bytes)
            .map(|(t, _)| t)
            .unwrap_or_default();
        ModelInfo {
            description: format!("{architecture} {size} {ty}"),
            file_bytes,
            parameters,
            weight_bytes_per_token,
        }
    }
}

/// A model loaded, with the pool of its KV cache's pages.
type Loaded<B> = Result<(Llama<B>, PagePool)>;

impl<B: Backend + 'static> Session<B>
where
    Llama<B>: Send,
{
    /// Loads a model split over `ranks` ([`Llama::load_sharded`]).
    pub fn load_sharded(path: &Path, ranks: Vec<Rank<B>>, options: LoadOptions) -> Result<Session<B>> {
        Self::from_files_sharded(ModelFiles::open(path)?, ranks, options)
    }

    /// [`Session::from_files`] split over `ranks`.
    pub fn from_files_sharded(files: ModelFiles, ranks: Vec<Rank<B>>, options: LoadOptions) -> Result<Session<B>> {
        Self::open(files, |source, config| {
            Llama::load_sharded(source, config, ranks, options)
        })
    }
}

impl<B: Backend> Session<B> {
    /// [`Session::from_files`] as this process's one rank of a group of processes
    /// ([`Llama::load_rank`]); a rank other than 0 then [`follow`](Llama::follow)s rank 0.
    pub fn from_files_rank(files: ModelFiles, rank: Rank<B>, options: LoadOptions) -> Result<Session<B>> {
        Self::open(files, |source, config| Llama::load_rank(source, config, rank, options))
    }

    /// Loads a GGUF file, or a Hugging Face model directory (config.json, safetensors,
    /// tokenizer.json).
    pub fn load(path: &Path, backend: B, options: LoadOptions) -> Result<Session<B>> {
        Self::from_files(ModelFiles::open(path)?, backend, options)
    }

    /// Loads a model already opened, reading nothing of it again. The files are taken so that
    /// their maps are released once the weights are on the backend.
    pub fn from_files(files: ModelFiles, backend: B, options: LoadOptions) -> Result<Session<B>> {
        Self::open(files, |source, config| Llama::load(source, config, backend, options))
    }

    /// Loads a GGUF image already parsed (tests build them in memory).
    pub fn from_gguf(file: &GgufFile, backend: B, options: LoadOptions) -> Result<Session<B>> {
        let load = |source: &dyn TensorSource, config| Llama::load(source, config, backend, options);
        Self::gguf(file, ModelConfig::from_gguf(file)?, load)
    }

    fn open(files: ModelFiles, load: impl FnOnce(&dyn TensorSource, ModelConfig) -> Loaded<B>) -> Result<Session<B>> {
        let ModelFiles {
            path,
            config,
            container,
        } = files;
        match &container {
            Container::Gguf(file) => Self::gguf(file, config, load),
            Container::HfDir(checkpoint) => Self::hf_dir(&path, checkpoint, config, load),
        }
    }

    fn gguf(
        file: &GgufFile,
        config: ModelConfig,
        load: impl FnOnce(&dyn TensorSource, ModelConfig) -> Loaded<B>,
    ) -> Result<Session<B>> {
        let tokenizer = Tokenizer::from_gguf(file)?;
        let template = file
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .or_else(|| crate::chat::builtin_template(&config.architecture))
            .map(str::to_owned);
        let model = load(file, config)?;
        let size_label = file.get("general.size_label").and_then(Value::as_str);
        let info = ModelInfo::new(file, &model.0.config, size_label, file.file_size());
        Self::assemble(model, tokenizer, template, info)
    }

    fn hf_dir(
        dir: &Path,
        checkpoint: &SafetensorsModel,
        config: ModelConfig,
        load: impl FnOnce(&dyn TensorSource, ModelConfig) -> Loaded<B>,
    ) -> Result<Session<B>> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name)).map_err(Error::io(format!("reading {}", dir.join(name).display())))
        };
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        // transformers 5 keeps the template in its own file; earlier versions in the tokenizer config.
        let template = read("chat_template.jinja").ok().or_else(|| {
            let tc: serde_json::Value = serde_json::from_str(&read("tokenizer_config.json").ok()?).ok()?;
            match &tc["chat_template"] {
                serde_json::Value::String(t) => Some(t.clone()),
                serde_json::Value::Array(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_owned),
                _ => None,
            }
        });
        let info = ModelInfo::new(checkpoint, &config, None, checkpoint.file_size());
        let model = load(checkpoint, config)?;
        Self::assemble(model, tokenizer, template, info)
    }

    fn assemble(
        (model, pages): (Llama<B>, PagePool),
        tokenizer: Tokenizer,
        template: Option<String>,
        info: ModelInfo,
    ) -> Result<Session<B>> {
        if tokenizer.vocab_size() > model.config.vocab_size {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model only {} embeddings",
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        let token_string = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
        let chat_template = match template {
            Some(source) => Some(ChatTemplate::new(
                &source,
                &token_string(tokenizer.bos),
                &token_string(tokenizer.eos),
            )?),
            None => None,
        };
        Ok(Session {
            model,
            pages,
            tokenizer,
            chat_template,
            info,
        })
    }

    /// [`Llama::forward`] after giving `kv` its pages for `tokens`, whose full pages it then
    /// indexes for prefix sharing.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        kv: &mut KvCache,
        rows: LogitRows,
        sink: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.pages.reserve(kv, tokens.len())?;
        self.model.forward(tokens, kv, rows, sink)?;
        self.pages.after_step(kv);
        Ok(())
    }

    /// [`Llama::forward_last`], the pages given and indexed as by [`Session::forward`].
    pub fn forward_last(&mut self, tokens: &[u32], kv: &mut KvCache) -> Result<&[f32]> {
        self.pages.reserve(kv, tokens.len())?;
        self.model.forward_last(tokens, kv)?;
        self.pages.after_step(kv);
        Ok(self.model.last_logits())
    }

    /// Token ids for a raw prompt (BOS added if the model wants it, special-token text parsed).
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, true, true)
    }

    /// Token ids for a conversation rendered with the model's chat template and an open
    /// assistant turn, the messages' content read as plain text. The template supplies BOS
    /// itself, as in transformers' `apply_chat_template`.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::Template("the model has no chat template".into()))?;
        self.tokenizer.encode_chat(&template.render_chat(messages, true)?)
    }
}
