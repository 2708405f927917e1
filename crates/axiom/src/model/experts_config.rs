//! The mixture-of-experts part of a config: how many experts, how many a token runs, how their
//! weights are normalized, a shared expert, and which layers are mixtures; from GGUF metadata or
//! a Hugging Face `config.json`.

use super::config::hf_usize;
use crate::format::gguf::GgufFile;
use crate::{Error, Result};
use serde_json::Value as Json;

/// Most experts a layer may have, and a token may run: far beyond any released model (8 of 128
/// for Qwen3-MoE), small enough that every buffer's size fits a `usize`.
const MAX_EXPERTS: usize = 1 << 12;
const MAX_USED: usize = 64;

#[derive(Debug, Clone, PartialEq)]
pub struct ExpertsConfig {
    pub count: usize,
    /// Experts each token runs (top-k).
    pub used: usize,
    /// Each expert's feed-forward width.
    pub ffn_dim: usize,
    /// The chosen experts' weights are divided by their sum (Mixtral; Qwen's `norm_topk_prob`).
    pub renormalize: bool,
    /// The width of the expert every token runs, gated by its own sigmoid (Qwen2-MoE).
    pub shared_ffn_dim: Option<usize>,
    /// Per layer: whether its feed-forward block is the mixture (else the dense one of the
    /// model's `ffn_dim`).
    pub layers: Vec<bool>,
}

impl ExpertsConfig {
    /// Whether layer `layer`'s feed-forward block is a mixture of experts.
    pub fn is_mixture(&self, layer: usize) -> bool {
        self.layers.get(layer) == Some(&true)
    }

    pub fn validate(&self, n_layers: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Model(what));
        if self.count == 0 || self.count > MAX_EXPERTS || self.used == 0 || self.used > self.count.min(MAX_USED) {
            return bad(format!(
                "{} experts of {} a token (at most {MAX_EXPERTS} experts, 1 to {MAX_USED} of them a token)",
                self.count, self.used
            ));
        }
        for (name, w) in [("expert", Some(self.ffn_dim)), ("shared expert", self.shared_ffn_dim)] {
            if let Some(w) = w.filter(|&w| w == 0 || w > super::config::MAX_FFN) {
                return bad(format!("{name} feed-forward length {w} is out of range"));
            }
        }
        if self.layers.len() != n_layers {
            return bad(format!("experts over {} of {n_layers} layers", self.layers.len()));
        }
        Ok(())
    }

    /// From `config.json` for the `model_type`s with experts; `None` for the others (and for a
    /// Qwen MoE config of no experts, which transformers runs dense).
    pub fn from_hf(config: &Json, model_type: &str, n_layers: usize) -> Result<Option<ExpertsConfig>> {
        let bad = |what: String| Error::Model(format!("config.json: {what}"));
        let usize_of = |k: &str| hf_usize(config, k);
        let required = |k: &str| usize_of(k)?.ok_or_else(|| bad(format!("missing {k}")));
        let experts = match model_type {
            "mixtral" => ExpertsConfig {
                count: required("num_local_experts")?,
                used: usize_of("num_experts_per_tok")?.unwrap_or(2),
                ffn_dim: required("intermediate_size")?,
                renormalize: true,
                shared_ffn_dim: None,
                layers: vec![true; n_layers],
            },
            "qwen2_moe" | "qwen3_moe" => {
                // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
                let count = match usize_of("num_experts")? {
                    Some(n) => n,
                    None => required("num_local_experts")?,
                };
                if count == 0 {
                    return Ok(None);
                }
                let step = usize_of("decoder_sparse_step")?.unwrap_or(1);
                if step == 0 {
                    return Err(bad("decoder_sparse_step is 0".into()));
                }
                let dense: Vec<usize> = match &config["mlp_only_layers"] {
                    Json::Null => Vec::new(),
                    Json::Array(layers) => layers
                        .iter()
                        .map(|l| {
                            l.as_u64()
                                .map(|l| l as usize)
                                .ok_or_else(|| bad(format!("mlp_only_layers holds {l}, not a layer")))
                        })
                        .collect::<Result<_>>()?,
                    v => return Err(bad(format!("mlp_only_layers is {v}, not a list of layers"))),
                };
                let shared_ffn_dim = match model_type {
                    "qwen2_moe" => Some(required("shared_expert_intermediate_size")?),
                    _ => None,
                };
                ExpertsConfig {
                    count,
                    used: required("num_experts_per_tok")?,
                    ffn_dim: required("moe_intermediate_size")?,
                    renormalize: config["norm_topk_prob"].as_bool() == Some(true),
                    shared_ffn_dim,
                    layers: (0..n_layers)
                        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                        .collect(),
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(experts))
    }

    /// From GGUF metadata: `{arch}.expert_count` above 0 (llama.cpp writes Mixtral as `llama`
    /// with experts). A layer is a mixture where the file has its router, `ffn_gate_inp`.
    pub fn from_gguf(file: &GgufFile, arch: &str, n_layers: usize, ffn_dim: usize) -> Result<Option<ExpertsConfig>> {
        let key = |k: &str| format!("{arch}.{k}");
        let count = match file.get_usize(&key("expert_count"))? {
            None | Some(0) => return Ok(None),
            Some(n) => n,
        };
        let used = file
            .get_usize(&key("expert_used_count"))?
            .ok_or_else(|| Error::Model(format!("missing {}", key("expert_used_count"))))?;
        // llama.cpp's gating: a softmax (1) unless the file says otherwise; weights unscaled.
        if let Some(f) = file.get_usize(&key("expert_gating_func"))?.filter(|&f| f != 1) {
            return Err(Error::Model(format!(
                "{} {f}: only the softmax (1) is supported",
                key("expert_gating_func")
            )));
        }
        if let Some(s) = file
            .get(&key("expert_weights_scale"))
            .and_then(|v| v.as_f64())
            .filter(|&s| s != 1.0)
        {
            return Err(Error::Model(format!(
                "{} {s}: scaled expert weights are not supported",
                key("expert_weights_scale")
            )));
        }
        // Without the key, llama.cpp renormalizes Mixtral's and Qwen3-MoE's, not Qwen2-MoE's.
        let renormalize = match file.get(&key("expert_weights_norm")) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::Model(format!("{} is not a boolean", key("expert_weights_norm"))))?,
            None => arch != "qwen2moe",
        };
        let experts = ExpertsConfig {
            count,
            used,
            ffn_dim: file.get_usize(&key("expert_feed_forward_length"))?.unwrap_or(ffn_dim),
            renormalize,
            shared_ffn_dim: file.get_usize(&key("expert_shared_feed_forward_length"))?,
            layers: (0..n_layers)
                .map(|i| file.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some())
                .collect(),
        };
        Ok(Some(experts))
    }
}
