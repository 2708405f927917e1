//! One normalized set of hyperparameters, whatever the file format: GGUF metadata or a Hugging
//! Face `config.json`. Anything that would change the math and is not understood is an error,
//! never a silently different model.

use super::experts_config::ExpertsConfig;
use super::quantization::Fp8Quantization;
use super::rope_config::{rope_from_gguf, rope_from_hf, LongRopeFactors};
use crate::backend::{Activation, AttentionShape, Rope, RopeLayout, RopeScaling, Scores};
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
    /// The feed-forward gate's activation: SiLU, or GELU (tanh) for Gemma.
    pub activation: Activation,
    /// The attention and feed-forward outputs are normalized too before they join the residual
    /// stream (Gemma 2 and 3).
    pub post_norms: bool,
    /// Embeddings are multiplied by this on the way in (Gemma: the square root of `dim`).
    pub embed_scale: Option<f32>,
    /// What the file's norm weights are stored minus: Gemma's Hugging Face checkpoints keep
    /// `w - 1` for a norm that multiplies by `w` (GGUF files store `w`).
    pub norm_weight_offset: f32,
    /// The attention scores' scale (`1/sqrt(head_dim)` unless the model says otherwise).
    pub attention_scale: f32,
    /// Attention scores capped to `±cap` by `cap * tanh(s / cap)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// The final logits capped the same way (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Sliding-window attention, where layers use it.
    pub sliding: Option<SlidingWindow>,
    /// Mixture-of-experts feed-forward blocks, where layers have them.
    pub experts: Option<ExpertsConfig>,
    /// How the checkpoint's FP8 weights are scaled (Hugging Face FP8 directories).
    pub quantization: Option<Fp8Quantization>,
}

/// Layers that attend only to the last `window` positions (Mistral v0.1, Qwen2's upper layers,
/// Gemma's local layers).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    /// Per layer: whether it slides.
    pub layers: Vec<bool>,
    /// The sliding layers' own rotary embedding where it differs from the others' (Gemma 3's
    /// local base frequency).
    pub rope: Option<Rope>,
}

/// Upper bounds that keep a corrupt header from sizing huge buffers.
const MAX_DIM: usize = 1 << 17;
const MAX_LAYERS: usize = 1024;
const MAX_CONTEXT: usize = 1 << 24;
pub(super) const MAX_FFN: usize = MAX_DIM * 4;

/// The architectures axiom runs, by their Hugging Face `model_type` / GGUF architecture name.
const ARCHITECTURES: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3_text",
];

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
            "qwen2" | "qwen3" | "qwen2moe" | "qwen3moe" | "phi3" | "gemma2" | "gemma3" => RopeLayout::Halves,
            _ => return Err(Error::UnsupportedArchitecture(arch)),
        };
        let gemma = arch.starts_with("gemma");
        let key = |k: &str| format!("{arch}.{k}");
        let usize_of = |k: &str| file.get_usize(&key(k));
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
        let n_layers = required("block_count")?;
        let sliding = match usize_of("attention.sliding_window")? {
            None => None,
            Some(window) => {
                let layers = match file.get(&key("attention.sliding_window_pattern")) {
                    Some(v) => match v.as_array() {
                        Some(flags) if flags.len() == n_layers => flags
                            .iter()
                            .map(|f| {
                                f.as_bool().ok_or_else(|| {
                                    Error::Model(format!(
                                        "{} holds a non-boolean",
                                        key("attention.sliding_window_pattern")
                                    ))
                                })
                            })
                            .collect::<Result<Vec<bool>>>()?,
                        _ => {
                            return Err(Error::Model(format!(
                                "{} is not one boolean per layer",
                                key("attention.sliding_window_pattern")
                            )))
                        }
                    },
                    // llama.cpp's fixed patterns: every other layer (Gemma 2), five of six
                    // (Gemma 3), all of them (Mistral v0.1-style files).
                    None => (0..n_layers)
                        .map(|i| match arch.as_str() {
                            "gemma2" => i % 2 == 0,
                            "gemma3" => i % 6 < 5,
                            _ => true,
                        })
                        .collect(),
                };
                // llama.cpp gives Gemma 3's local layers a base of 10000 and no scaling.
                let local_rope = match (arch.as_str(), float_of("rope.freq_base_swa")) {
                    (_, Some(theta)) => Some(Rope {
                        theta: theta as f32,
                        scaling: RopeScaling::None,
                        scale: 1.0,
                        ..rope
                    }),
                    ("gemma3", None) => Some(Rope {
                        theta: 10000.0,
                        scaling: RopeScaling::None,
                        scale: 1.0,
                        ..rope
                    }),
                    _ => None,
                };
                Some(SlidingWindow {
                    window,
                    layers,
                    rope: local_rope,
                })
            }
        };
        // llama.cpp scales Gemma's scores by the head dimension, but the 27B models' by the
        // model's width per head (their `query_pre_attn_scalar`); `attention.scale` overrides both.
        let attention_scale = match float_of("attention.scale") {
            Some(s) => s as f32,
            None => {
                let per_head = match (arch.as_str(), n_layers) {
                    ("gemma2", 46) | ("gemma3", 62) => dim / n_heads.max(1),
                    _ => head_dim,
                };
                1.0 / (per_head as f32).sqrt()
            }
        };
        let softcap = |k: &str| float_of(k).filter(|&c| c > 0.0).map(|c| c as f32);
        let ffn_dim = required("feed_forward_length")?;
        let config = ModelConfig {
            n_layers,
            dim,
            ffn_dim,
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
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            post_norms: file.tensor("blk.0.post_attention_norm.weight").is_some(),
            embed_scale: gemma.then(|| (dim as f32).sqrt()),
            norm_weight_offset: 0.0,
            attention_scale,
            attn_softcap: softcap("attn_logit_softcapping"),
            final_softcap: softcap("final_logit_softcapping"),
            sliding,
            experts: ExpertsConfig::from_gguf(file, &arch, n_layers, ffn_dim)?,
            quantization: None,
            architecture: arch,
        };
        config.validate()?;
        Ok(config)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf(config: &Json) -> Result<ModelConfig> {
        let model_type = config["model_type"].as_str().unwrap_or_default().to_string();
        if model_type == "gemma3" {
            return Err(Error::UnsupportedArchitecture(
                "gemma3 (Gemma3ForConditionalGeneration: text and vision; axiom runs the text-only gemma3_text)".into(),
            ));
        }
        if !ARCHITECTURES.contains(&model_type.as_str()) {
            let named = config["architectures"]
                .get(0)
                .and_then(Json::as_str)
                .unwrap_or("none given");
            return Err(Error::UnsupportedArchitecture(format!("{model_type} ({named})")));
        }
        let bad = |what: String| Error::Model(format!("config.json: {what}"));
        let usize_of = |k: &str| hf_usize(config, k);
        let required = |k: &str| usize_of(k)?.ok_or_else(|| bad(format!("missing {k}")));
        let float_of = |v: &Json| v.as_f64();

        let gemma = model_type.starts_with("gemma");
        // Settings that would change the math are either understood or refused. Gemma's
        // modeling code reads `hidden_activation`, the others' `hidden_act`.
        let act_key = if gemma { "hidden_activation" } else { "hidden_act" };
        let activation = match config[act_key].as_str() {
            None if gemma => Activation::GeluTanh,
            None | Some("silu") => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluTanh,
            Some(act) => {
                return Err(bad(format!(
                    "activation {act:?} is not supported (silu, gelu_pytorch_tanh)"
                )))
            }
        };
        if config["use_bidirectional_attention"].as_bool() == Some(true) {
            return Err(bad(
                "use_bidirectional_attention: only causal attention is supported".into()
            ));
        }
        if config["mlp_bias"].as_bool() == Some(true) {
            return Err(bad("mlp_bias: MLP biases are not supported".into()));
        }
        // transformers gives Llama and Qwen3 all four attention biases under `attention_bias`,
        // Qwen2 always Q, K and V but never the output's, and Mistral none (it reads no such field).
        let attention_bias = config["attention_bias"].as_bool() == Some(true);
        let (qkv_bias, o_bias) = match model_type.as_str() {
            "qwen2" => (true, false),
            // Qwen2-MoE names its Q, K and V biases `qkv_bias`.
            "qwen2_moe" => (config["qkv_bias"].as_bool() != Some(false), false),
            "mistral" | "mixtral" | "phi3" => (false, false),
            _ => (attention_bias, attention_bias),
        };
        let n_heads = required("num_attention_heads")?;
        let dim = required("hidden_size")?;
        let context_length = usize_of("max_position_embeddings")?.unwrap_or(4096);
        let n_layers = required("num_hidden_layers")?;
        let head_dim = usize_of("head_dim")?.unwrap_or(dim.checked_div(n_heads).unwrap_or(0));
        let (rope, longrope, local_rope) = match &config["rope_parameters"] {
            // Gemma 3 in transformers 5: rope parameters per layer type.
            p if p["full_attention"].is_object() => {
                let of = |params: &Json| {
                    let mut c = config.clone();
                    c["rope_parameters"] = params.clone();
                    rope_from_hf(&c, &model_type, head_dim)
                };
                let (rope, longrope) = of(&p["full_attention"])?;
                let local = match &p["sliding_attention"] {
                    q if q.is_object() => Some(of(q)?.0),
                    _ => None,
                };
                (rope, longrope, local)
            }
            _ => {
                let (rope, longrope) = rope_from_hf(config, &model_type, head_dim)?;
                // Earlier Gemma 3 configs give the sliding layers' base as `rope_local_base_freq`.
                let local = (model_type == "gemma3_text").then(|| Rope {
                    theta: float_of(&config["rope_local_base_freq"]).unwrap_or(10000.0) as f32,
                    scaling: RopeScaling::None,
                    scale: 1.0,
                    ..rope
                });
                (rope, longrope, local)
            }
        };
        let sliding = sliding_window(config, &model_type, n_layers)?.map(|s| SlidingWindow { rope: local_rope, ..s });
        // A window over the whole context changes nothing but the rope it may carry.
        let sliding = sliding.filter(|s| s.window < context_length || s.rope.is_some());
        let attention_scale = match float_of(&config["query_pre_attn_scalar"]) {
            Some(s) if gemma => (1.0 / s.sqrt()) as f32,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let softcap = |k: &str| float_of(&config[k]).filter(|_| gemma).map(|c| c as f32);
        let config_out = ModelConfig {
            n_layers,
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
            qk_norm: matches!(model_type.as_str(), "qwen3" | "qwen3_moe" | "gemma3_text"),
            rope_factors: None,
            longrope,
            activation,
            post_norms: gemma,
            embed_scale: gemma.then(|| (dim as f32).sqrt()),
            norm_weight_offset: if gemma { 1.0 } else { 0.0 },
            attention_scale,
            attn_softcap: softcap("attn_logit_softcapping"),
            final_softcap: softcap("final_logit_softcapping"),
            sliding,
            experts: ExpertsConfig::from_hf(config, &model_type, n_layers)?,
            quantization: Fp8Quantization::from_hf(config)?,
            architecture: model_type,
        };
        config_out.validate()?;
        Ok(config_out)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Model(what));
        for (name, v, max) in [
            ("embedding length", self.dim, MAX_DIM),
            ("feed-forward length", self.ffn_dim, MAX_FFN),
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
        if let Some(s) = &self.sliding {
            if s.window == 0 || s.layers.len() != self.n_layers {
                return bad(format!(
                    "a sliding window of {} tokens over {} of {} layers",
                    s.window,
                    s.layers.len(),
                    self.n_layers
                ));
            }
        }
        for cap in [self.attn_softcap, self.final_softcap].into_iter().flatten() {
            if !(cap.is_finite() && cap > 0.0) {
                return bad(format!("a soft cap of {cap} is not positive"));
            }
        }
        if !(self.attention_scale.is_finite() && self.attention_scale > 0.0) {
            return bad(format!("attention scale {} is not positive", self.attention_scale));
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
        if let Some(experts) = &self.experts {
            experts.validate(self.n_layers)?;
            // No family normalizes a mixture's output before the residual stream.
            if self.post_norms {
                return bad("mixture-of-experts layers with post-norms are not supported".into());
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

    /// Whether layer `layer` attends through a sliding window.
    pub fn slides(&self, layer: usize) -> bool {
        self.sliding
            .as_ref()
            .is_some_and(|s| s.layers.get(layer) == Some(&true))
    }

    /// How layer `layer` scores what it attends to.
    pub fn scores(&self, layer: usize) -> Scores {
        Scores {
            scale: self.attention_scale,
            softcap: self.attn_softcap,
            window: self.sliding.as_ref().filter(|_| self.slides(layer)).map(|s| s.window),
        }
    }

    /// The window every layer attends through, where all of them slide (Mistral v0.1): what lies
    /// behind it is never read again.
    pub fn window_of_every_layer(&self) -> Option<usize> {
        self.sliding
            .as_ref()
            .filter(|s| s.layers.iter().all(|&b| b))
            .map(|s| s.window)
    }

    /// The sliding layers' own rotary embedding, where it differs from the others'.
    pub fn local_rope(&self) -> Option<Rope> {
        self.sliding.as_ref().and_then(|s| s.rope)
    }
}

/// The sliding window of a Hugging Face config, as transformers applies it: Mistral's to every
/// layer, Qwen's (with `use_sliding_window`) from `max_window_layers` on, Gemma's to the layers
/// `layer_types` names (by default every other one for Gemma 2, five of six for Gemma 3).
/// `key` of config.json as a count: `None` when absent, an error naming it when it is not a
/// non-negative integer.
pub(super) fn hf_usize(config: &Json, key: &str) -> Result<Option<usize>> {
    match &config[key] {
        Json::Null => Ok(None),
        v => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| Error::Model(format!("config.json: {key} is not a non-negative integer"))),
    }
}

fn sliding_window(config: &Json, model_type: &str, n_layers: usize) -> Result<Option<SlidingWindow>> {
    let bad = |what: String| Error::Model(format!("config.json: {what}"));
    let window = match &config["sliding_window"] {
        Json::Null => return Ok(None),
        v => v
            .as_u64()
            .map(|w| w as usize)
            .ok_or_else(|| bad("sliding_window is not a non-negative integer".into()))?,
    };
    let named: Option<Vec<bool>> = match &config["layer_types"] {
        Json::Null => None,
        Json::Array(types) if types.len() == n_layers => Some(
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(bad(format!("layer type {t} is not supported"))),
                })
                .collect::<Result<_>>()?,
        ),
        _ => return Err(bad(format!("layer_types is not one type per layer ({n_layers})"))),
    };
    let layers: Vec<bool> = match model_type {
        "mistral" | "mixtral" | "phi3" => vec![true; n_layers],
        // transformers' Qwen MoE windows are not the dense Qwens' (every layer for Qwen3-MoE,
        // every other one below `max_window_layers` for Qwen2-MoE); no released model slides.
        "qwen2_moe" | "qwen3_moe" if config["use_sliding_window"].as_bool() == Some(true) => {
            return Err(bad(format!(
                "use_sliding_window: sliding windows are not supported for {model_type}"
            )))
        }
        "qwen2" | "qwen3" => {
            if config["use_sliding_window"].as_bool() != Some(true) {
                return Ok(None);
            }
            let from = config["max_window_layers"].as_u64().unwrap_or(28) as usize;
            named.unwrap_or_else(|| (0..n_layers).map(|i| i >= from).collect())
        }
        "gemma2" => named.unwrap_or_else(|| (0..n_layers).map(|i| (i + 1) % 2 != 0).collect()),
        "gemma3_text" => {
            let period = config["sliding_window_pattern"].as_u64().unwrap_or(6).max(1) as usize;
            named.unwrap_or_else(|| (0..n_layers).map(|i| (i + 1) % period != 0).collect())
        }
        // transformers' Llama has no sliding window: it ignores the field.
        _ => return Ok(None),
    };
    if !layers.contains(&true) {
        return Ok(None);
    }
    Ok(Some(SlidingWindow {
        window,
        layers,
        rope: None,
    }))
}
