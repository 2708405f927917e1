//! Rotary embedding settings from a `config.json` (transformers' `rope_parameters`) or from GGUF
//! metadata (llama.cpp's `rope.*` keys), and LongRoPE's per-pair factor lists.

use crate::backend::{yarn_mscale, Rope, RopeLayout, RopeScaling, Yarn};
use crate::format::gguf::GgufFile;
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use serde_json::Value as Json;

/// LongRoPE's per-pair divisors of the rope frequencies: `short` while every sequence fits the
/// original context, `long` beyond it.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRopeFactors {
    pub short: Vec<f32>,
    pub long: Vec<f32>,
}

/// GGUF tensor names of LongRoPE's factor lists (llama.cpp's).
pub const LONGROPE_SHORT: &str = "rope_factors_short.weight";
pub const LONGROPE_LONG: &str = "rope_factors_long.weight";

/// The rope settings of a Hugging Face `config.json` whose heads have `head_dim` dimensions.
pub fn rope_from_hf(config: &Json, model_type: &str, head_dim: usize) -> Result<(Rope, Option<LongRopeFactors>)> {
    let bad = |what: String| Error::Model(format!("config.json: {what}"));
    // transformers 5 writes `rope_parameters`; earlier versions `rope_theta` + `rope_scaling`.
    let params = if config["rope_parameters"].is_object() {
        &config["rope_parameters"]
    } else {
        &config["rope_scaling"]
    };
    let theta = params["rope_theta"]
        .as_f64()
        .or(config["rope_theta"].as_f64())
        .unwrap_or(10000.0) as f32;
    let partial = params["partial_rotary_factor"]
        .as_f64()
        .or(config["partial_rotary_factor"].as_f64())
        .unwrap_or(1.0);
    // Only Phi-3's attention rotates part of a head; transformers' other models would fail on it.
    if partial != 1.0 && model_type != "phi3" {
        return Err(bad(format!(
            "partial_rotary_factor {partial} is not supported for {model_type}"
        )));
    }
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(bad(format!("partial_rotary_factor {partial} is not in (0, 1]")));
    }
    let dims = (head_dim as f64 * partial) as usize;
    let mut rope_type = params["rope_type"]
        .as_str()
        .or(params["type"].as_str())
        .unwrap_or("default");
    // Phi-3's config class reads its older names for LongRoPE as LongRoPE.
    if model_type == "phi3" && matches!(rope_type, "su" | "yarn") {
        rope_type = "longrope";
    }
    let max_positions = config["max_position_embeddings"].as_u64().unwrap_or(4096) as usize;
    // A top-level `original_max_position_embeddings` wins over the one in the rope parameters
    // (transformers' rule, for Phi-3's configs); Phi-3's config class defaults it to 4096.
    let original_context = || -> Result<usize> {
        let top = config["original_max_position_embeddings"].as_u64();
        let top = top.or((model_type == "phi3").then_some(4096));
        match top.or(params["original_max_position_embeddings"].as_u64()) {
            Some(0) => Err(bad("original_max_position_embeddings is 0".into())),
            Some(n) => Ok(n as usize),
            None => Ok(max_positions),
        }
    };
    let float = |key: &str| params[key].as_f64();
    let factor = || float("factor").unwrap_or(1.0) as f32;
    let mut longrope = None;
    let (scaling, scale) = match rope_type {
        "default" => (RopeScaling::None, 1.0),
        "linear" => (RopeScaling::Linear { factor: factor() }, 1.0),
        "llama3" => (
            RopeScaling::Llama3 {
                factor: factor(),
                low_freq_factor: float("low_freq_factor").unwrap_or(1.0) as f32,
                high_freq_factor: float("high_freq_factor").unwrap_or(4.0) as f32,
                original_context: params["original_max_position_embeddings"].as_u64().unwrap_or(8192) as usize,
            },
            1.0,
        ),
        "yarn" => {
            let original_context = original_context()?;
            let factor = float("factor").unwrap_or(max_positions as f64 / original_context as f64);
            // transformers treats a zero beta as absent.
            let beta = |key: &str, default: f64| float(key).filter(|b| *b != 0.0).unwrap_or(default);
            let attention_factor = match (float("attention_factor"), float("mscale"), float("mscale_all_dim")) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    yarn_mscale(factor, m) / yarn_mscale(factor, all)
                }
                _ => yarn_mscale(factor, 1.0),
            };
            let truncate = match &params["truncate"] {
                Json::Null => true,
                v => v.as_bool().ok_or_else(|| bad("rope truncate is not a boolean".into()))?,
            };
            (
                RopeScaling::Yarn(Yarn {
                    factor: factor as f32,
                    original_context,
                    beta_fast: beta("beta_fast", 32.0) as f32,
                    beta_slow: beta("beta_slow", 1.0) as f32,
                    truncate,
                }),
                attention_factor,
            )
        }
        "longrope" => {
            let original_context = original_context()?;
            let list = |key: &str| -> Result<Vec<f32>> {
                params[key]
                    .as_array()
                    .and_then(|a| a.iter().map(|v| v.as_f64().map(|x| x as f32)).collect())
                    .ok_or_else(|| bad(format!("longrope {key} is not a list of numbers")))
            };
            longrope = Some(LongRopeFactors {
                short: list("short_factor")?,
                long: list("long_factor")?,
            });
            let factor = float("factor").unwrap_or(max_positions as f64 / original_context as f64);
            let attention_factor = match float("attention_factor") {
                Some(a) => a,
                None => longrope_attention_factor(factor, original_context),
            };
            (RopeScaling::LongRope { original_context }, attention_factor)
        }
        // transformers recomputes dynamic NTK's frequencies from each forward pass's length, so
        // keys cached at one length were rotated for another: a paged cache cannot reproduce it.
        "dynamic" => {
            return Err(bad(
                "rope type \"dynamic\" (dynamic NTK) is not supported: transformers rescales every position by the current sequence length, which a KV cache of keys rotated earlier cannot follow".into(),
            ))
        }
        other => return Err(bad(format!("rope type {other:?} is not supported"))),
    };
    let rope = Rope {
        layout: RopeLayout::Halves,
        theta,
        dims,
        scaling,
        scale: scale as f32,
    };
    Ok((rope, longrope))
}

/// LongRoPE's attention factor when the config gives none: `sqrt(1 + ln(s) / ln(original))`
/// for a context stretched `s` times, 1 when not stretched.
fn longrope_attention_factor(factor: f64, original_context: usize) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original_context as f64).ln()).sqrt()
    }
}

/// The rope settings of a GGUF file of architecture `arch`: `layout`, and `dims` of `head_dim`
/// rotated unless the file says otherwise.
pub fn rope_from_gguf(
    file: &GgufFile,
    arch: &str,
    layout: RopeLayout,
    head_dim: usize,
) -> Result<(Rope, Option<LongRopeFactors>)> {
    let key = |k: &str| format!("{arch}.{k}");
    let float = |k: &str| file.get(&key(k)).and_then(|v| v.as_f64());
    let count = |k: &str| file.get_usize(&key(k));
    let dims = count("rope.dimension_count")?.unwrap_or(head_dim);
    // DeepSeek's YaRN magnitude and llama.cpp's extrapolation mix are not part of these models.
    for unread in ["rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor"] {
        if file.get(&key(unread)).is_some() {
            return Err(Error::Model(format!("{} is not supported", key(unread))));
        }
    }
    let attn_factor = float("rope.scaling.attn_factor");
    let original_context = || {
        count("rope.scaling.original_context_length")?
            .filter(|n| *n > 0)
            .ok_or_else(|| Error::Model(format!("missing {}", key("rope.scaling.original_context_length"))))
    };
    let longrope = longrope_factors(file, dims)?;
    let scaling_type = file.get(&key("rope.scaling.type")).and_then(|v| v.as_str());
    let (scaling, scale) = match (scaling_type, &longrope) {
        (None | Some("none"), Some(_)) => {
            let original_context = original_context()?;
            // llama.cpp's converter stores the attention factor; without it, it follows from
            // how far the context is stretched, as transformers computes it.
            let scale = match attn_factor {
                Some(a) => a,
                None => {
                    let context = count("context_length")?.unwrap_or(original_context);
                    longrope_attention_factor(context as f64 / original_context as f64, original_context)
                }
            };
            (RopeScaling::LongRope { original_context }, scale)
        }
        (None | Some("none"), None) => (RopeScaling::None, attn_factor.unwrap_or(1.0)),
        (Some("linear"), None) => (
            RopeScaling::Linear {
                factor: float("rope.scaling.factor").unwrap_or(1.0) as f32,
            },
            attn_factor.unwrap_or(1.0),
        ),
        (Some("yarn"), None) => {
            let factor = float("rope.scaling.factor")
                .ok_or_else(|| Error::Model(format!("missing {}", key("rope.scaling.factor"))))?;
            // llama.cpp multiplies its `attn_factor` by YaRN's own `0.1 ln(s) + 1`.
            let scale = attn_factor.unwrap_or(1.0) * yarn_mscale(factor, 1.0);
            (
                RopeScaling::Yarn(Yarn {
                    factor: factor as f32,
                    original_context: original_context()?,
                    beta_fast: float("rope.scaling.yarn_beta_fast").unwrap_or(32.0) as f32,
                    beta_slow: float("rope.scaling.yarn_beta_slow").unwrap_or(1.0) as f32,
                    truncate: true,
                }),
                scale,
            )
        }
        (Some(other), _) => {
            return Err(Error::Model(format!(
                "rope scaling {other:?} is not supported{}",
                if longrope.is_some() {
                    " with LongRoPE factors"
                } else {
                    ""
                }
            )))
        }
    };
    let theta = float("rope.freq_base").unwrap_or(10000.0) as f32;
    let rope = Rope {
        layout,
        theta,
        dims,
        scaling,
        scale: scale as f32,
    };
    Ok((rope, longrope))
}

/// LongRoPE's factor lists from a GGUF file's tensors, both or neither.
fn longrope_factors(file: &GgufFile, dims: usize) -> Result<Option<LongRopeFactors>> {
    let read = |name: &str| -> Result<Option<Vec<f32>>> {
        match file.tensor(name) {
            None => Ok(None),
            Some(t) if t.ty == GgmlType::F32 && t.dims == [dims / 2] => Ok(Some(
                file.tensor_bytes(t)
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )),
            Some(t) => Err(Error::Model(format!(
                "{name} has type {} and shape {:?}, expected F32 [{}]",
                t.ty,
                t.dims,
                dims / 2
            ))),
        }
    };
    match (read(LONGROPE_SHORT)?, read(LONGROPE_LONG)?) {
        (Some(short), Some(long)) => Ok(Some(LongRopeFactors { short, long })),
        (None, None) => Ok(None),
        _ => Err(Error::Model(format!(
            "a file with one of {LONGROPE_SHORT} and {LONGROPE_LONG} needs both"
        ))),
    }
}
