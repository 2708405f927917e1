//! One normalized set of hyperparameters, whatever the file format: GGUF metadata or a Hugging
//! Face `config.json`. Anything that would change the math and is not understood is an error,
//! never a silently different model.

use super::rope_config::{rope_from_gguf, rope_from_hf, LongRopeFactors};
use crate::backend::{AttentionShape, Rope, RopeLayout, RopeScaling};
use crate::format::gguf::GgufFile;
use crate::{Error, Result};
use serde_json::Value as Json;

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
    /// Q, K and V projections have biases (Qwen2; Llama and Qwen3 with `attention_bias`).
    pub qkv_bias: bool,
    /// The attention output projection has a bias (Llama and Qwen3 with `attention_bias`).
    pub o_bias: bool,
    /// Each head of Q and K is RMS-normalized before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Per-pair divisors of the rope frequencies (GGUF's `rope_freqs` tensor, Llama 3.1).
    pub rope_factors: Option<Vec<f32>>,
    /// LongRoPE's per-pair divisors (Phi-3), with `RopeScaling::LongRope`.
    pub longrope: Option<LongRopeFactors>,
}

/// Upper bounds that keep a corrupt header from sizing huge buffers.
const MAX_DIM: usize = 1 << 17;
const MAX_LAYERS: usize = 1024;
const MAX_CONTEXT: usize = 1 << 24;

/// The architectures axiom runs, by their Hugging Face `model_type` / GGUF architecture name.
const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "phi3"];

impl ModelConfig {
    pub fn attention(&self) -> AttentionShape {
        AttentionShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Bytes of KV cache one token takes, over all layers.
    pub fn kv_bytes_per_token(&self, kv_type: crate::backend::KvType) -> usize {
        2 * self.n_layers * self.attention().kv_width() * kv_type.bytes()
    }

    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch = file
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Error::Model("missing general.architecture".into()))?
            .to_string();
        // GGUF's llama converter permutes Q/K so that rotary pairs are adjacent; the Qwen
        // converters keep Hugging Face's rotate-half order (GGUF's "NeoX" rope).
        let layout = match arch.as_str() {
            "llama" | "mistral" => RopeLayout::Adjacent,
            "qwen2" | "qwen3" | "phi3" => RopeLayout::Halves,
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
        let (rope, longrope) = rope_from_gguf(file, &arch, layout, head_dim)?;
        let context_length = usize_of("context_length")?.unwrap_or(4096);
        // llama.cpp writes Phi-3-mini-4k's window of 2047 tokens; axiom attends to every position.
        if let Some(w) = usize_of("attention.sliding_window")?.filter(|w| *w < context_length) {
            return Err(Error::Model(format!(
                "a sliding window of {w} tokens (below the context of {context_length}) is not supported"
            )));
        }
        let rope_factors = match file.tensor("rope_freqs.weight") {
            Some(t) if t.ty == crate::format::quant::GgmlType::F32 && t.dims.len() == 1 => Some(
                file.tensor_bytes(t)
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            Some(t) => {
                return Err(Error::Model(format!(
                    "rope_freqs has type {} and shape {:?}, expected an F32 vector",
                    t.ty, t.dims
                )))
            }
            None => None,
        };
        let config = ModelConfig {
            n_layers: required("block_count")?,
            dim,
            ffn_dim: required("feed_forward_length")?,
            n_heads,
            n_kv_heads: usize_of("attention.head_count_kv")?.unwrap_or(n_heads),
            head_dim,
            vocab_size,
            context_length,
            rms_eps: float_of("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
            rope,
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            o_bias: file.tensor("blk.0.attn_output.bias").is_some(),
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
            rope_factors,
            longrope,
            architecture: arch,
        };
        config.validate()?;
        Ok(config)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf(config: &Json) -> Result<ModelConfig> {
        let model_type = config["model_type"].as_str().unwrap_or_default().to_string();
        if !ARCHITECTURES.contains(&model_type.as_str()) {
            let named = config["architectures"]
                .get(0)
                .and_then(Json::as_str)
                .unwrap_or("none given");
            return Err(Error::UnsupportedArchitecture(format!("{model_type} ({named})")));
        }
        let bad = |what: String| Error::Model(format!("config.json: {what}"));
        let usize_of = |k: &str| -> Result<Option<usize>> {
            match &config[k] {
                Json::Null => Ok(None),
                v => v
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| bad(format!("{k} is not a non-negative integer"))),
            }
        };
        let required = |k: &str| usize_of(k)?.ok_or_else(|| bad(format!("missing {k}")));
        let float_of = |v: &Json| v.as_f64();

        // Settings that would change the math are either understood or refused.
        if let Some(act) = config["hidden_act"].as_str().or(config["hidden_activation"].as_str()) {
            if act != "silu" {
                return Err(bad(format!("activation {act:?} is not supported (silu only)")));
            }
        }
        if config["mlp_bias"].as_bool() == Some(true) {
            return Err(bad("mlp_bias: MLP biases are not supported".into()));
        }
        // transformers gives Llama and Qwen3 all four attention biases under `attention_bias`,
        // Qwen2 always Q, K and V but never the output's, and Mistral none (it reads no such field).
        let attention_bias = config["attention_bias"].as_bool() == Some(true);
        let (qkv_bias, o_bias) = match model_type.as_str() {
            "qwen2" => (true, false),
            "mistral" | "phi3" => (false, false),
            _ => (attention_bias, attention_bias),
        };
        let n_heads = required("num_attention_heads")?;
        let dim = required("hidden_size")?;
        let context_length = usize_of("max_position_embeddings")?.unwrap_or(4096);
        let window = usize_of("sliding_window")?;
        // Mistral and Phi-3 use any window they are given; Qwen2 only with `use_sliding_window`.
        let window_used = config["use_sliding_window"]
            .as_bool()
            .unwrap_or(matches!(model_type.as_str(), "mistral" | "phi3"));
        if let (Some(w), true) = (window, window_used) {
            if w < context_length {
                return Err(bad(format!(
                    "a sliding window of {w} tokens (below the context of {context_length}) is not supported"
                )));
            }
        }
        let head_dim = usize_of("head_dim")?.unwrap_or(dim.checked_div(n_heads).unwrap_or(0));
        let (rope, longrope) = rope_from_hf(config, &model_type, head_dim)?;
        let config_out = ModelConfig {
            n_layers: required("num_hidden_layers")?,
            dim,
            ffn_dim: required("intermediate_size")?,
            n_heads,
            n_kv_heads: usize_of("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            vocab_size: required("vocab_size")?,
            context_length,
            rms_eps: float_of(&config["rms_norm_eps"]).unwrap_or(1e-6) as f32,
            rope,
            qkv_bias,
            o_bias,
            qk_norm: model_type == "qwen3",
            rope_factors: None,
            longrope,
            architecture: model_type,
        };
        config_out.validate()?;
        Ok(config_out)
    }

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
        if !(self.rope.scale.is_finite() && self.rope.scale > 0.0) {
            return bad(format!("rope attention factor {} is not positive", self.rope.scale));
        }
        match (&self.longrope, self.rope.scaling) {
            (Some(l), RopeScaling::LongRope { .. }) => {
                let pairs = self.rope.dims / 2;
                for list in [&l.short, &l.long] {
                    if list.len() != pairs || list.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                        return bad(format!(
                            "LongRoPE has {} factors for {pairs} rotated pairs, or one not positive",
                            list.len()
                        ));
                    }
                }
            }
            (None, RopeScaling::LongRope { .. }) => return bad("LongRoPE without its factors".into()),
            (Some(_), _) => return bad("LongRoPE factors without LongRoPE scaling".into()),
            (None, _) => {}
        }
        if let Some(f) = &self.rope_factors {
            if f.len() != self.rope.dims / 2 || f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                return bad(format!(
                    "rope_freqs has {} factors for {} rotated pairs, or one not positive",
                    f.len(),
                    self.rope.dims / 2
                ));
            }
        }
        Ok(())
    }

    /// The rope kernels' frequency table for sequences of up to `longest_sequence` tokens: the
    /// scaled frequencies, divided by any per-pair factors. LongRoPE takes its long factors when
    /// a sequence may outgrow the original context, as llama.cpp does: transformers switches per
    /// forward pass, which keys already cached cannot follow.
    pub fn rope_frequencies(&self, longest_sequence: usize) -> Vec<f32> {
        let mut freqs = self.rope.inverse_frequencies();
        let longrope = match (&self.longrope, self.rope.scaling) {
            (Some(l), RopeScaling::LongRope { original_context }) => Some(if longest_sequence > original_context {
                &l.long
            } else {
                &l.short
            }),
            _ => None,
        };
        for factors in [self.rope_factors.as_ref(), longrope].into_iter().flatten() {
            freqs.iter_mut().zip(factors).for_each(|(f, d)| *f /= d);
        }
        freqs
    }
}
