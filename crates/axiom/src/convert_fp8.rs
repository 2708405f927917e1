//! `axiom convert --type fp8`: a Hugging Face model directory written as an FP8 one, laid out as
//! transformers' FineGrainedFP8 (Qwen3-FP8, DeepSeek-V3) publishes them: each layer's weight
//! matrix as `float8_e4m3fn` with a `weight_scale_inv` per 128 x 128 block, everything else as
//! stored, and `quantization_config` added to config.json. Routers stay in their float type (a
//! rounded logit can change the experts chosen), and so do matrices that are not whole 128 x 128
//! blocks (which readers split differently); both are listed in `modules_to_not_convert`. A model
//! with no matrix to convert is refused.

use crate::convert::Written;
use crate::format::fp8::{quantize_blockwise, SCALE_BLOCK};
use crate::format::quant::{dequantize, GgmlType};
use crate::format::safetensors::SafetensorsModel;
use crate::model::ModelConfig;
use crate::{Error, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::path::Path;

/// Files of the source directory not copied: the checkpoint, which is rewritten, and the config,
/// which gains the quantization.
fn rewritten(name: &str) -> bool {
    name == "config.json" || name.ends_with(".safetensors") || name == "model.safetensors.index.json"
}

/// A router's weight, by the names transformers gives them (Qwen's `mlp.gate`, Mixtral's
/// `block_sparse_moe.gate`, Qwen2-MoE's `shared_expert_gate`).
fn is_router(name: &str) -> bool {
    name.ends_with(".gate.weight") || name.ends_with(".shared_expert_gate.weight")
}

fn is_layer_matrix(name: &str, dims: &[usize]) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".weight") && dims.len() == 2
}

/// Whether a tensor (`dims` in either order) becomes FP8: a layer's matrix of whole
/// 128 x 128 blocks, but not a router.
fn converts(name: &str, dims: &[usize]) -> bool {
    is_layer_matrix(name, dims) && !is_router(name) && dims.iter().all(|d| d.is_multiple_of(SCALE_BLOCK))
}

fn dtype(ty: GgmlType) -> Result<Dtype> {
    match ty {
        GgmlType::F32 => Ok(Dtype::F32),
        GgmlType::F16 => Ok(Dtype::F16),
        GgmlType::BF16 => Ok(Dtype::BF16),
        other => Err(Error::Model(format!("cannot write a {other} tensor to safetensors"))),
    }
}

/// A written tensor's bytes: the source's as stored, or the `owned` buffer of this index.
enum Bytes<'a> {
    Stored(&'a [u8]),
    Owned(usize),
}

/// Converts the model directory `dir` into the FP8 directory `out` (created; it must not exist or
/// be empty). `progress(done, total, name)` follows the tensors.
pub fn convert_to_fp8(dir: &Path, out: &Path, mut progress: impl FnMut(usize, usize, &str)) -> Result<Written> {
    let config_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(Error::io(format!("reading {}", config_path.display())))?;
    let mut json: Json = serde_json::from_str(&text).map_err(|e| Error::Model(format!("config.json: {e}")))?;
    // The source must be a model axiom runs, in a float type.
    let config = ModelConfig::from_hf(&json)?;
    if let Some(q) = &config.quantization {
        return Err(Error::InvalidArgument(format!(
            "{} is already quantized ({q})",
            dir.display()
        )));
    }
    let checkpoint = SafetensorsModel::open_dir(dir, None)?;
    // A directory with no matrix to convert would name FP8 quantization over float weights only,
    // which no reader loads.
    if !checkpoint.names().any(|(name, entry)| converts(name, &entry.dims)) {
        return Err(Error::InvalidArgument(format!(
            "{}: no layer matrix is whole {SCALE_BLOCK}x{SCALE_BLOCK} blocks, so none converts to FP8",
            dir.display()
        )));
    }
    if out.read_dir().is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(Error::InvalidArgument(format!(
            "{} exists and is not empty",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(Error::io(format!("creating {}", out.display())))?;

    let mut names: Vec<&str> = checkpoint.names().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    let mut written = Written {
        matrices: Vec::new(),
        vectors: 0,
    };
    let mut not_converted = Vec::new();
    // The quantized tensors' bytes, and every tensor as (name, dtype, shape, its bytes).
    let mut owned: Vec<Vec<u8>> = Vec::new();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Bytes)> = Vec::new();
    for (i, &name) in names.iter().enumerate() {
        progress(i, names.len(), name);
        let entry = checkpoint
            .get(name)
            .ok_or_else(|| Error::Model(format!("missing tensor {name}")))?;
        let bytes = checkpoint.bytes(entry);
        let shape: Vec<usize> = entry.dims.iter().rev().copied().collect();
        if !is_layer_matrix(name, &shape) {
            if shape.len() >= 2 {
                written.add_matrix(entry.ty);
            } else {
                written.vectors += 1;
            }
            tensors.push((name.to_string(), dtype(entry.ty)?, shape, Bytes::Stored(bytes)));
            continue;
        }
        let (n_out, n_in) = (shape[0], shape[1]);
        if !converts(name, &entry.dims) {
            not_converted.push(name.trim_end_matches(".weight").to_string());
            written.add_matrix(entry.ty);
            tensors.push((name.to_string(), dtype(entry.ty)?, shape, Bytes::Stored(bytes)));
            continue;
        }
        let mut values = vec![0f32; n_in * n_out];
        dequantize(entry.ty, bytes, &mut values);
        let (codes, scales) = quantize_blockwise(&values, n_in, n_out);
        tensors.push((name.to_string(), Dtype::F8_E4M3, shape, Bytes::Owned(owned.len())));
        owned.push(codes);
        let scale_shape = vec![n_out.div_ceil(SCALE_BLOCK), n_in.div_ceil(SCALE_BLOCK)];
        let scale_name = format!("{name}_scale_inv");
        tensors.push((scale_name, Dtype::F32, scale_shape, Bytes::Owned(owned.len())));
        owned.push(scales.iter().flat_map(|s| s.to_le_bytes()).collect());
        written.add_matrix(GgmlType::Fp8);
    }
    progress(names.len(), names.len(), "");

    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let data = match bytes {
                Bytes::Stored(b) => b,
                Bytes::Owned(i) => owned[*i].as_slice(),
            };
            TensorView::new(*dtype, shape.clone(), data)
                .map(|view| (name.as_str(), view))
                .map_err(|e| Error::Model(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let model = out.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(metadata), &model)
        .map_err(|e| Error::Model(format!("writing {}: {e}", model.display())))?;

    if checkpoint.get("lm_head.weight").is_some() {
        not_converted.insert(0, "lm_head".to_string());
    }
    json["quantization_config"] = json!({
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [SCALE_BLOCK, SCALE_BLOCK],
        "modules_to_not_convert": not_converted,
    });
    let config_text = serde_json::to_string_pretty(&json).map_err(|e| Error::Model(format!("config.json: {e}")))?;
    let config_out = out.join("config.json");
    std::fs::write(&config_out, config_text + "\n").map_err(Error::io(format!("writing {}", config_out.display())))?;
    for file in std::fs::read_dir(dir).map_err(Error::io(format!("reading {}", dir.display())))? {
        let file = file.map_err(Error::io(format!("reading {}", dir.display())))?;
        let name = file.file_name();
        let is_file = file.file_type().is_ok_and(|t| t.is_file());
        if is_file && !rewritten(&name.to_string_lossy()) {
            std::fs::copy(file.path(), out.join(&name))
                .map_err(Error::io(format!("copying {}", file.path().display())))?;
        }
    }
    Ok(written)
}
