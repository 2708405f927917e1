//! One normalized set of hyperparameters, whatever the file format.

use crate::backend::{AttentionShape, Rope, RopeLayout};
use crate::format::gguf::GgufFile;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope: Rope,
}

/// Upper bounds that keep a corrupt header from sizing huge buffers.
const MAX_DIM: usize = 1 << 17;
const MAX_LAYERS: usize = 1024;
const MAX_CONTEXT: usize = 1 << 24;

impl ModelConfig {
    pub fn attention(&self) -> AttentionShape {
        AttentionShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }

    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch = file
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Error::Model("missing general.architecture".into()))?
            .to_string();
        // GGUF stores Llama and Mistral as "llama"; Q/K were permuted by the converter so that
        // rotary pairs are adjacent.
        let layout = match arch.as_str() {
            "llama" | "mistral" => RopeLayout::Adjacent,
            _ => return Err(Error::UnsupportedArchitecture(arch)),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let usize_of = |k: &str| -> Result<Option<usize>> {
            match file.get(&key(k)) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| Error::Model(format!("{} is not a non-negative integer", key(k)))),
            }
        };
        let required = |k: &str| usize_of(k)?.ok_or_else(|| Error::Model(format!("missing {}", key(k))));
        let float_of = |k: &str| file.get(&key(k)).and_then(|v| v.as_f64());

        let dim = required("embedding_length")?;
        let n_heads = required("attention.head_count")?;
        let n_kv_heads = usize_of("attention.head_count_kv")?.unwrap_or(n_heads);
        let head_dim = match usize_of("attention.key_length")? {
            Some(d) => d,
            None if n_heads > 0 => dim / n_heads,
            None => 0,
        };
        let vocab_size = match usize_of("vocab_size")? {
            Some(v) => v,
            None => file
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| Error::Model("cannot tell the vocabulary size".into()))?,
        };
        let config = ModelConfig {
            n_layers: required("block_count")?,
            dim,
            ffn_dim: required("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length: usize_of("context_length")?.unwrap_or(4096),
            rms_eps: float_of("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
            rope: Rope {
                layout,
                theta: float_of("rope.freq_base").unwrap_or(10000.0) as f32,
                dims: usize_of("rope.dimension_count")?.unwrap_or(head_dim),
            },
            architecture: arch.clone(),
        };
        if let Some(scaling) = file.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            if scaling != "none" {
                return Err(Error::Model(format!("rope scaling {scaling:?} is not supported yet")));
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Rejects shapes the forward pass cannot run, before anything is sized from them.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Model(what));
        for (name, v, max) in [
            ("embedding length", self.dim, MAX_DIM),
            ("feed-forward length", self.ffn_dim, MAX_DIM * 4),
            ("head count", self.n_heads, MAX_DIM),
            ("KV head count", self.n_kv_heads, MAX_DIM),
            ("head dimension", self.head_dim, MAX_DIM),
            ("layer count", self.n_layers, MAX_LAYERS),
            ("vocabulary size", self.vocab_size, 1 << 22),
            ("context length", self.context_length, MAX_CONTEXT),
        ] {
            if v == 0 || v > max {
                return bad(format!("{name} {v} is out of range (1..={max})"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads cannot be grouped over {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.rope.dims.is_multiple_of(2) || self.rope.dims > self.head_dim {
            return bad(format!(
                "rope dimension {} does not fit head dimension {}",
                self.rope.dims, self.head_dim
            ));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0 && self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!(
                "rope theta {} / rms epsilon {} are invalid",
                self.rope.theta, self.rms_eps
            ));
        }
        Ok(())
    }
}
