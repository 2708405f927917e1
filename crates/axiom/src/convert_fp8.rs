//! `axiom convert --type fp8 [--fp8-block N]`: a Hugging Face model directory written as an FP8
//! one, laid out as transformers' FineGrainedFP8 (Qwen3-FP8, DeepSeek-V3) publishes them: each
//! layer's weight matrix as `float8_e4m3fn` with a `weight_scale_inv` per N x N block (128 by
//! default, as those use), everything else as stored, and `quantization_config` added to
//! config.json. Routers stay in their float type (a rounded logit can change the experts chosen),
//! and so do matrices that are not whole blocks (which readers split differently); both are
//! listed in `modules_to_not_convert`. A model with no matrix to convert is refused, naming the
//! block sizes that would convert it.

use crate::convert::Written;
use crate::format::fp8::{quantize_blockwise, ScaleBlock, CODES_PER_BLOCK};
use crate::format::quant::{dequantize, GgmlType};
use crate::format::safetensors::SafetensorsModel;
use crate::model::ModelConfig;
use crate::{Error, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::path::Path;

/// The rows and columns of a scale's block unless asked otherwise: Qwen3-FP8's and DeepSeek-V3's.
pub const DEFAULT_BLOCK: usize = 128;

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

/// Whether a tensor (`dims` in either order) becomes FP8 in square blocks of `block`: a layer's
/// matrix of whole blocks, but not a router.
fn converts(name: &str, dims: &[usize], block: usize) -> bool {
    is_layer_matrix(name, dims) && !is_router(name) && dims.iter().all(|d| d.is_multiple_of(block))
}

/// Refuses a block size transformers could not run: its Triton FP8 kernels tile a block's rows
/// and columns in powers of two, and axiom's own FP8 blocks hold 32 weights of a row.
fn check_block(block: usize) -> Result<()> {
    match block.is_power_of_two() && block >= CODES_PER_BLOCK {
        true => Ok(()),
        false => Err(Error::InvalidArgument(format!(
            "FP8 block size {block} is not supported (a power of two, {CODES_PER_BLOCK} or more)"
        ))),
    }
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
/// be empty), a scale per `block` x `block` weights. `progress(done, total, name)` follows the
/// tensors.
pub fn convert_to_fp8(
    dir: &Path,
    out: &Path,
    block: usize,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<Written> {
    check_block(block)?;
    let scale_block = ScaleBlock::square(block);
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
    let any_converts = |block| {
        checkpoint
            .names()
            .any(|(name, entry)| converts(name, &entry.dims, block))
    };
    if !any_converts(block) {
        // Halving the block keeps every whole matrix whole, so only smaller ones can fit.
        let smaller: Vec<String> = std::iter::successors(Some(block / 2), |b| Some(b / 2))
            .take_while(|&b| b >= CODES_PER_BLOCK)
            .filter(|&b| any_converts(b))
            .map(|b| b.to_string())
            .collect();
        let fits = match smaller.as_slice() {
            [] => "and no smaller block size fits".to_string(),
            [one] => format!("--fp8-block {one} fits"),
            [many @ .., last] => format!("--fp8-block {} or {last} fits", many.join(", ")),
        };
        return Err(Error::InvalidArgument(format!(
            "{}: no layer matrix is whole {scale_block} blocks, so none converts to FP8; {fits}",
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
        if !converts(name, &entry.dims, block) {
            not_converted.push(name.trim_end_matches(".weight").to_string());
            written.add_matrix(entry.ty);
            tensors.push((name.to_string(), dtype(entry.ty)?, shape, Bytes::Stored(bytes)));
            continue;
        }
        let mut values = vec![0f32; n_in * n_out];
        dequantize(entry.ty, bytes, &mut values);
        let (codes, scales) = quantize_blockwise(&values, n_in, n_out, scale_block);
        tensors.push((name.to_string(), Dtype::F8_E4M3, shape, Bytes::Owned(owned.len())));
        owned.push(codes);
        let scale_shape = scale_block.grid(n_out, n_in).to_vec();
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
        "weight_block_size": [block, block],
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
