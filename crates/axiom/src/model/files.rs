//! A model on disk, opened as far as its configuration and size: enough for a caller to size the
//! KV cache and check memory before any weights load, and for the load to read nothing again.

use super::config::ModelConfig;
use crate::format::gguf::GgufFile;
use crate::format::safetensors::SafetensorsModel;
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The open container the weights are read from.
pub enum Container {
    Gguf(GgufFile),
    /// A Hugging Face directory's checkpoint; its tokenizer and template are read at load.
    HfDir(SafetensorsModel),
}

pub struct ModelFiles {
    /// The GGUF file or the model directory.
    pub path: PathBuf,
    pub config: ModelConfig,
    pub container: Container,
}

impl ModelFiles {
    /// Opens a GGUF file, or a Hugging Face model directory (config.json and safetensors).
    pub fn open(path: &Path) -> Result<ModelFiles> {
        let (config, container) = if path.is_dir() {
            let file = path.join("config.json");
            let text = std::fs::read_to_string(&file).map_err(Error::io(format!("reading {}", file.display())))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::Model(format!("config.json: {e}")))?;
            let config = ModelConfig::from_hf(&json)?;
            let checkpoint = SafetensorsModel::open_dir(path, config.quantization.as_ref())?;
            (config, Container::HfDir(checkpoint))
        } else {
            let file = GgufFile::open(path)?;
            (ModelConfig::from_gguf(&file)?, Container::Gguf(file))
        };
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            container,
        })
    }

    /// Bytes of weights on disk: the GGUF file, or the directory's safetensors files together
    /// (not its tokenizer and other files).
    pub fn weight_bytes(&self) -> usize {
        match &self.container {
            Container::Gguf(file) => file.file_size(),
            Container::HfDir(checkpoint) => checkpoint.file_size(),
        }
    }
}
