//! A Hugging Face `quantization_config`: the FP8 checkpoints axiom reads (float8_e4m3fn weights
//! with f32 scales), each setting either understood or refused by name.
//!
//! Which matrices are FP8 is read from the stored dtypes, so the lists of modules left in their
//! float type (`modules_to_not_convert`, `ignore`) agree with any checkpoint. Dynamic activation
//! scales are accepted: they quantize activations on the fly, and running on the exact
//! activations computes what the weights define (so does fbgemm's `activation_scale_ub`, the
//! bound on those scales).

use crate::format::fp8::{ScaleBlock, CODES_PER_BLOCK};
use crate::{Error, Result};
use serde_json::Value as Json;
use std::fmt;

/// What one scale of an FP8 weight covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scales {
    /// A block of rows and columns: `weight_scale_inv` of the block's grid over the matrix.
    Blocks(ScaleBlock),
    /// A row (output channel): `weight_scale` of `[n_out, 1]`.
    Channel,
    /// The whole matrix: `weight_scale` of one value.
    Tensor,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Quantization {
    /// The `quant_method`: `fp8`, `compressed-tensors` or `fbgemm_fp8`.
    pub method: String,
    pub scales: Fp8Scales,
}

impl Fp8Quantization {
    /// The name of the scale tensor of the FP8 weight `weight` ("....q_proj.weight").
    pub fn scale_name(&self, weight: &str) -> String {
        match self.scales {
            Fp8Scales::Blocks(_) => format!("{weight}_scale_inv"),
            Fp8Scales::Channel | Fp8Scales::Tensor => format!("{weight}_scale"),
        }
    }

    /// From `config.json`'s `quantization_config`; `None` where there is none.
    pub fn from_hf(config: &Json) -> Result<Option<Fp8Quantization>> {
        let q = &config["quantization_config"];
        if q.is_null() {
            return Ok(None);
        }
        let method = q["quant_method"].as_str().unwrap_or("none given");
        let scales = match method {
            "fp8" => fine_grained(q)?,
            "compressed-tensors" => compressed_tensors(q)?,
            "fbgemm_fp8" => {
                only_keys(
                    q,
                    "fbgemm_fp8",
                    &["quant_method", "modules_to_not_convert", "activation_scale_ub"],
                )?;
                Fp8Scales::Channel
            }
            other => {
                return Err(refused(format!(
                    "quant_method {other:?} is not supported (fp8, compressed-tensors, fbgemm_fp8)"
                )))
            }
        };
        Ok(Some(Fp8Quantization {
            method: method.to_string(),
            scales,
        }))
    }
}

impl fmt::Display for Fp8Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scales = match self.scales {
            Fp8Scales::Blocks(block) => format!("a scale per {block} block"),
            Fp8Scales::Channel => "a scale per output channel".into(),
            Fp8Scales::Tensor => "a scale per matrix".into(),
        };
        write!(f, "FP8 E4M3 weights, {scales} ({})", self.method)
    }
}

fn refused(what: String) -> Error {
    Error::Model(format!("config.json: quantization_config: {what}"))
}

/// Refuses any key of `q` outside `known`, naming it.
fn only_keys(q: &Json, what: &str, known: &[&str]) -> Result<()> {
    let Some(object) = q.as_object() else {
        return Err(refused("not an object".into()));
    };
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(refused(format!("{key} is not supported for {what}"))),
        None => Ok(()),
    }
}

/// A list of module names, or null.
fn module_list(q: &Json, key: &str) -> Result<()> {
    match &q[key] {
        Json::Null => Ok(()),
        Json::Array(items) if items.iter().all(Json::is_string) => Ok(()),
        other => Err(refused(format!("{key} is {other}, expected a list of module names"))),
    }
}

/// transformers' FineGrainedFP8 (Qwen3-FP8 and DeepSeek-V3 with 128 x 128 blocks): blocks whose
/// columns are whole `Fp8` blocks of a row, so that each keeps its scale exactly.
fn fine_grained(q: &Json) -> Result<Fp8Scales> {
    only_keys(
        q,
        "fp8",
        &[
            "quant_method",
            "activation_scheme",
            "weight_block_size",
            "fmt",
            "modules_to_not_convert",
            "modules_to_convert",
            "scale_fmt",
            "expert_dtype",
            "dequantize",
        ],
    )?;
    match q["activation_scheme"].as_str() {
        None | Some("dynamic") => {}
        Some(other) => {
            return Err(refused(format!(
                "activation_scheme {other:?} is not supported (static input scales; dynamic)"
            )))
        }
    }
    let block = block_size(&q["weight_block_size"])?;
    for (key, allowed) in [("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")] {
        if let Some(v) = q.get(key).filter(|v| v.as_str() != Some(allowed)) {
            return Err(refused(format!("{key} {v} is not supported ({allowed:?})")));
        }
    }
    if !matches!(q["dequantize"], Json::Null | Json::Bool(_)) {
        return Err(refused(format!(
            "dequantize is {}, expected true or false",
            q["dequantize"]
        )));
    }
    module_list(q, "modules_to_not_convert")?;
    module_list(q, "modules_to_convert")?;
    Ok(Fp8Scales::Blocks(block))
}

/// `weight_block_size`: `[rows, columns]` of positive integers, the columns a multiple of 32.
fn block_size(size: &Json) -> Result<ScaleBlock> {
    let dims = size.as_array().map(|b| b.iter().map(Json::as_u64).collect::<Vec<_>>());
    let block = match dims.as_deref() {
        Some(&[Some(rows), Some(cols)]) if rows > 0 && cols > 0 => ScaleBlock {
            rows: rows as usize,
            cols: cols as usize,
        },
        _ => {
            return Err(refused(format!(
                "weight_block_size {size} is not supported (two positive integers, [rows, columns])"
            )))
        }
    };
    if !block.cols.is_multiple_of(CODES_PER_BLOCK) {
        return Err(refused(format!(
            "weight_block_size {size} is not supported: its columns, {}, are not a multiple of \
             {CODES_PER_BLOCK} (axiom keeps a scale per {CODES_PER_BLOCK} weights of a row)",
            block.cols
        )));
    }
    Ok(block)
}

/// compressed-tensors' `float-quantized` format (llm-compressor's FP8 and FP8_DYNAMIC schemes):
/// one group of 8-bit float weights with a scale per channel or per tensor.
fn compressed_tensors(q: &Json) -> Result<Fp8Scales> {
    only_keys(
        q,
        "compressed-tensors",
        &[
            "quant_method",
            "format",
            "config_groups",
            "ignore",
            "kv_cache_scheme",
            "quantization_status",
            "global_compression_ratio",
            "sparsity_config",
            "transform_config",
            "version",
        ],
    )?;
    if q["format"].as_str() != Some("float-quantized") {
        return Err(refused(format!(
            "format {} is not supported (\"float-quantized\")",
            q["format"]
        )));
    }
    if q["quantization_status"].as_str() != Some("compressed") {
        return Err(refused(format!(
            "quantization_status {} is not supported (\"compressed\")",
            q["quantization_status"]
        )));
    }
    for key in ["kv_cache_scheme", "transform_config"] {
        if !q[key].is_null() {
            return Err(refused(format!("{key} is not supported")));
        }
    }
    if q["sparsity_config"].as_object().is_some_and(|s| !s.is_empty()) {
        return Err(refused("sparsity_config is not supported".into()));
    }
    module_list(q, "ignore")?;
    let groups = q["config_groups"].as_object().map(|g| g.values().collect::<Vec<_>>());
    let [group] = groups.as_deref().unwrap_or_default() else {
        return Err(refused("config_groups: one group is supported".into()));
    };
    only_keys(
        group,
        "compressed-tensors config_groups",
        &[
            "targets",
            "weights",
            "input_activations",
            "output_activations",
            "format",
        ],
    )?;
    for (key, allowed) in [
        ("targets", Json::from(vec!["Linear"])),
        ("output_activations", Json::Null),
    ] {
        if group[key] != allowed {
            return Err(refused(format!("config_groups: {key} {} is not supported", group[key])));
        }
    }
    if !matches!(group["format"].as_str(), None | Some("float-quantized")) {
        return Err(refused(format!(
            "config_groups: format {} is not supported",
            group["format"]
        )));
    }
    let weights = &group["weights"];
    let float8 = |args: &Json| args["num_bits"].as_u64() == Some(8) && args["type"].as_str() == Some("float");
    if !float8(weights) || weights["symmetric"] == false || weights["dynamic"] == true {
        return Err(refused(format!(
            "config_groups: weights {weights} are not supported (static symmetric 8-bit float)"
        )));
    }
    let inputs = &group["input_activations"];
    let dynamic_float8 = float8(inputs) && inputs["dynamic"] == true;
    if !(inputs.is_null() || dynamic_float8) {
        return Err(refused(format!(
            "config_groups: input_activations {inputs} are not supported (none, or dynamic 8-bit float)"
        )));
    }
    match weights["strategy"].as_str() {
        Some("channel") => Ok(Fp8Scales::Channel),
        Some("tensor") => Ok(Fp8Scales::Tensor),
        other => Err(refused(format!(
            "config_groups: weight strategy {other:?} is not supported (channel, tensor)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(q: Json) -> Result<Option<Fp8Quantization>> {
        Fp8Quantization::from_hf(&json!({ "quantization_config": q }))
    }

    #[test]
    fn qwen3_fp8s_config_reads_as_blocks() {
        let q = parse(
            json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}),
        );
        let q = q.unwrap().unwrap();
        assert_eq!(q.scales, Fp8Scales::Blocks(ScaleBlock::square(128)));
        assert_eq!(q.to_string(), "FP8 E4M3 weights, a scale per 128x128 block (fp8)");
    }

    #[test]
    fn blocks_of_whole_32_value_columns_are_read() {
        for [rows, cols] in [[64, 64], [32, 32], [1, 96], [48, 128], [128, 32]] {
            let q = parse(json!({"quant_method": "fp8", "weight_block_size": [rows, cols]}));
            assert_eq!(q.unwrap().unwrap().scales, Fp8Scales::Blocks(ScaleBlock { rows, cols }));
        }
        let refused = |size: Json| {
            parse(json!({"quant_method": "fp8", "weight_block_size": size}))
                .unwrap_err()
                .to_string()
        };
        for size in [json!([64, 48]), json!([128, 16]), json!([32, 1])] {
            let err = refused(size.clone());
            assert!(
                err.contains(&format!("weight_block_size {size}")) && err.contains("multiple of 32"),
                "{err}"
            );
        }
        for size in [
            json!([0, 32]),
            json!([32, -32]),
            json!([128]),
            json!([128, 128, 1]),
            json!("128"),
            Json::Null,
        ] {
            let err = refused(size.clone());
            assert!(
                err.contains(&format!("weight_block_size {size}")) && err.contains("two positive"),
                "{err}"
            );
        }
    }

    #[test]
    fn unsupported_settings_are_refused_by_name() {
        let fp8 = json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        let with = |key: &str, v: Json| {
            let mut q = fp8.clone();
            q[key] = v;
            parse(q).unwrap_err().to_string()
        };
        assert!(with("weight_block_size", json!([64, 40])).contains("weight_block_size"));
        assert!(with("activation_scheme", json!("static")).contains("static"));
        assert!(with("fmt", json!("e5m2")).contains("fmt"));
        assert!(with("scale_fmt", json!("ue8m0")).contains("scale_fmt"));
        assert!(with("group_size", json!(64)).contains("group_size"));
        assert!(parse(json!({"quant_method": "awq"}))
            .unwrap_err()
            .to_string()
            .contains("awq"));
    }
}
