//! `axiom convert`: a Hugging Face model directory written as one GGUF file, its weight matrices
//! optionally quantized (llama-quantize's job). The result loads like any GGUF, in axiom or in
//! llama.cpp: Llama and Mistral become GGUF `llama` (Q and K rows permuted to adjacent rotary
//! pairs, as llama.cpp's converter does), Qwen2, Qwen3, Phi-3 and Gemma 2 keep their own
//! architecture names (Phi-3 its fused Q/K/V and gate/up matrices, as llama.cpp stores them),
//! Gemma 3's text model becomes `gemma3`; Gemma's norm weights are written as the norm
//! multiplies by them (its checkpoints store them minus one), as llama.cpp's converter does.
//! Mixtures of experts take llama.cpp's form: Mixtral is `llama` with experts, Qwen's are
//! `qwen2moe` and `qwen3moe`, each layer's experts stacked into 3-D tensors (`ffn_gate_exps`,
//! ...), the routers kept in F32 as llama-quantize keeps them.

use crate::backend::HostTensor;
use crate::backend::RopeScaling;
use crate::format::gguf::Value;
use crate::format::gguf_writer::GgufWriter;
use crate::format::quant::{dequantize, GgmlType};
use crate::format::quantize::{can_quantize, quantize};
use crate::format::safetensors::SafetensorsModel;
use crate::model::rope_config::{LONGROPE_LONG, LONGROPE_SHORT};
use crate::model::weights::{expert_tensors, refuse_unread, TensorSource};
use crate::model::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use serde_json::Value as Json;
use std::collections::HashSet;
use std::path::Path;

/// What `convert_hf_dir` wrote: how many matrices went into each type, in the order the types
/// first appeared (the type asked for, or Q8_0 or F32 where rows do not fit its blocks), and how
/// many vectors (norms, biases: always F32). `convert_fp8` counts the same way, keeping what it
/// does not quantize in its stored type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub matrices: Vec<(GgmlType, usize)>,
    pub vectors: usize,
}

impl Written {
    pub(crate) fn add_matrix(&mut self, ty: GgmlType) {
        match self.matrices.iter_mut().find(|(t, _)| *t == ty) {
            Some((_, n)) => *n += 1,
            None => self.matrices.push((ty, 1)),
        }
    }
}

/// Converts `dir` to the GGUF file `out`, matrices in `ty` (where their rows fit its blocks;
/// otherwise Q8_0, or F32 as the last resort). `progress(done, total, name)` follows the tensors.
pub fn convert_hf_dir(
    dir: &Path,
    out: &Path,
    ty: GgmlType,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<Written> {
    if !can_quantize(ty) {
        return Err(Error::InvalidArgument(format!(
            "cannot write {ty}: choose F32, F16, BF16, Q8_0, Q4_0, Q5_0 or Q4_K"
        )));
    }
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).map_err(Error::io(format!("reading {}", dir.join(name).display())))
    };
    let json: Json =
        serde_json::from_str(&read("config.json")?).map_err(|e| Error::Model(format!("config.json: {e}")))?;
    let config = ModelConfig::from_hf(&json)?;
    let checkpoint = SafetensorsModel::open_dir(dir, config.quantization.as_ref())?;
    let arch = match config.architecture.as_str() {
        // llama.cpp writes Mixtral as `llama` with experts.
        "llama" | "mistral" | "mixtral" => "llama",
        "gemma3_text" => "gemma3",
        "qwen2_moe" => "qwen2moe",
        "qwen3_moe" => "qwen3moe",
        other => other,
    };
    let permute = arch == "llama";
    let mut w = GgufWriter::default();
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let u32v = |v: usize| Value::U32(v as u32);
    w.set("general.architecture", Value::String(arch.into()));
    w.set("general.name", Value::String(name));
    w.set(&format!("{arch}.block_count"), u32v(config.n_layers));
    w.set(&format!("{arch}.context_length"), u32v(config.context_length));
    w.set(&format!("{arch}.embedding_length"), u32v(config.dim));
    w.set(&format!("{arch}.feed_forward_length"), u32v(config.ffn_dim));
    w.set(&format!("{arch}.attention.head_count"), u32v(config.n_heads));
    w.set(&format!("{arch}.attention.head_count_kv"), u32v(config.n_kv_heads));
    w.set(&format!("{arch}.attention.key_length"), u32v(config.head_dim));
    w.set(&format!("{arch}.attention.value_length"), u32v(config.head_dim));
    w.set(&format!("{arch}.rope.dimension_count"), u32v(config.rope.dims));
    w.set(&format!("{arch}.rope.freq_base"), Value::F32(config.rope.theta));
    w.set(
        &format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(config.rms_eps),
    );
    w.set(&format!("{arch}.vocab_size"), u32v(config.vocab_size));
    rope_metadata(&config, arch, &mut w)?;
    sliding_metadata(&config, arch, &mut w)?;
    if let Some(e) = &config.experts {
        w.set(&format!("{arch}.expert_count"), u32v(e.count));
        w.set(&format!("{arch}.expert_used_count"), u32v(e.used));
        w.set(&format!("{arch}.expert_feed_forward_length"), u32v(e.ffn_dim));
        // llama.cpp assumes it per architecture where the key is missing; written, it is read.
        w.set(&format!("{arch}.expert_weights_norm"), Value::Bool(e.renormalize));
        if let Some(shared) = e.shared_ffn_dim {
            w.set(&format!("{arch}.expert_shared_feed_forward_length"), u32v(shared));
        }
    }
    if config.attention_scale != 1.0 / (config.head_dim as f32).sqrt() || arch.starts_with("gemma") {
        w.set(&format!("{arch}.attention.scale"), Value::F32(config.attention_scale));
    }
    for (key, cap) in [
        ("attn_logit_softcapping", config.attn_softcap),
        ("final_logit_softcapping", config.final_softcap),
    ] {
        if let Some(cap) = cap {
            w.set(&format!("{arch}.{key}"), Value::F32(cap));
        }
    }
    tokenizer_metadata(dir, &mut w)?;
    if let Ok(template) = read("chat_template.jinja") {
        w.set("tokenizer.chat_template", Value::String(template));
    } else if let Some(t) = serde_json::from_str::<Json>(&read("tokenizer_config.json").unwrap_or_default())
        .ok()
        .and_then(|c| c["chat_template"].as_str().map(str::to_owned))
    {
        w.set("tokenizer.chat_template", Value::String(t));
    }

    // Llama 3.1's frequency scaling travels as per-pair divisors, llama.cpp's `rope_freqs`.
    if let RopeScaling::Llama3 { .. } = config.rope.scaling {
        let base = crate::backend::Rope {
            scaling: RopeScaling::None,
            ..config.rope
        }
        .inverse_frequencies();
        let factors: Vec<u8> = base
            .iter()
            .zip(config.rope.inverse_frequencies())
            .flat_map(|(b, s)| (b / s).to_le_bytes())
            .collect();
        w.tensor("rope_freqs.weight", GgmlType::F32, &[config.rope.dims / 2], factors)?;
    }

    let names = tensor_names(&config, checkpoint.tensor("output.weight").is_some());
    let mut read: HashSet<&str> = HashSet::new();
    for name in &names {
        // A missing tensor is named when it is written, below.
        if let Ok(parts) = source_tensors(&checkpoint, &config, name) {
            read.extend(parts.iter().map(|t| t.name));
        }
    }
    refuse_unread(&checkpoint, &read)?;
    let mut written = Written {
        matrices: Vec::new(),
        vectors: 0,
    };
    for (i, gguf_name) in names.iter().enumerate() {
        progress(i, names.len(), gguf_name);
        let parts = source_tensors(&checkpoint, &config, gguf_name)?;
        let (mut values, dims) = (Vec::new(), stored_dims(&parts));
        for t in &parts {
            let start = values.len();
            values.resize(start + t.dims.iter().product::<usize>(), 0.0);
            dequantize(t.ty, t.bytes, &mut values[start..]);
        }
        let n = values.len();
        if gguf_name.ends_with("norm.weight") {
            values.iter_mut().for_each(|v| *v += config.norm_weight_offset);
        }
        if permute {
            let heads = match gguf_name.rsplit('.').nth(1) {
                Some("attn_q") => Some(config.n_heads),
                Some("attn_k") => Some(config.n_kv_heads),
                _ => None,
            };
            if let Some(heads) = heads {
                // A matrix's rows, or a bias vector's values.
                let (rows, row_len) = match dims[..] {
                    [row_len, rows] => (rows, row_len),
                    _ => (n, 1),
                };
                values = permute_rows(&values, heads, rows, row_len);
            }
        }
        // Routers stay F32, as llama-quantize leaves them: a rounded logit can change the choice.
        let router = gguf_name.contains(".ffn_gate_inp");
        let target = if dims.len() >= 2 {
            let target = if router {
                GgmlType::F32
            } else {
                matrix_type(ty, dims[0])
            };
            written.add_matrix(target);
            target
        } else {
            written.vectors += 1;
            GgmlType::F32
        };
        let mut bytes = Vec::with_capacity(target.bytes_for(n).unwrap_or(0));
        quantize(target, &values, &mut bytes)?;
        w.tensor(&stored_name(gguf_name), target, &dims, bytes)?;
    }
    progress(names.len(), names.len(), "");
    w.write(out)?;
    Ok(written)
}

/// The rope scaling keys of llama.cpp's GGUF, and LongRoPE's factor tensors.
fn rope_metadata(config: &ModelConfig, arch: &str, w: &mut GgufWriter) -> Result<()> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    match config.rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            w.set(&key("type"), Value::String("linear".into()));
            w.set(&key("factor"), Value::F32(factor));
        }
        // Travels as `rope_freqs` (below).
        RopeScaling::Llama3 { .. } => {}
        RopeScaling::Yarn(yarn) => {
            // llama.cpp always rounds YaRN's ramp outwards, and has no key saying otherwise.
            if !yarn.truncate {
                return Err(Error::Model(
                    "YaRN with truncate: false cannot be written to GGUF (llama.cpp always truncates)".into(),
                ));
            }
            w.set(&key("type"), Value::String("yarn".into()));
            w.set(&key("factor"), Value::F32(yarn.factor));
            w.set(
                &key("original_context_length"),
                Value::U32(yarn.original_context as u32),
            );
            w.set(&key("yarn_beta_fast"), Value::F32(yarn.beta_fast));
            w.set(&key("yarn_beta_slow"), Value::F32(yarn.beta_slow));
            // llama.cpp multiplies this by YaRN's own magnitude term.
            let attn_factor = config.rope.scale as f64 / crate::backend::yarn_mscale(yarn.factor as f64, 1.0);
            w.set(&key("attn_factor"), Value::F32(attn_factor as f32));
        }
        RopeScaling::LongRope { original_context } => {
            let longrope = config
                .longrope
                .as_ref()
                .ok_or_else(|| Error::Model("LongRoPE without its factors".into()))?;
            w.set(&key("original_context_length"), Value::U32(original_context as u32));
            w.set(&key("attn_factor"), Value::F32(config.rope.scale));
            for (name, factors) in [(LONGROPE_SHORT, &longrope.short), (LONGROPE_LONG, &longrope.long)] {
                let bytes = factors.iter().flat_map(|f| f.to_le_bytes()).collect();
                w.tensor(name, GgmlType::F32, &[factors.len()], bytes)?;
            }
        }
    }
    Ok(())
}

/// The checkpoint's tensors that make the GGUF tensor `name`: the one of that name, or, for a
/// stacked expert tensor (`ffn_gate_exps`, ...), each expert's matrix in expert order.
fn source_tensors<'s>(
    checkpoint: &'s SafetensorsModel,
    config: &ModelConfig,
    name: &str,
) -> Result<Vec<HostTensor<'s>>> {
    let stacked = name.strip_suffix(".weight").filter(|n| n.ends_with("_exps"));
    match (stacked, &config.experts) {
        (Some(stacked), Some(e)) => {
            let shape = if stacked.ends_with("ffn_down_exps") {
                [e.ffn_dim, config.dim]
            } else {
                [config.dim, e.ffn_dim]
            };
            expert_tensors(checkpoint, stacked, e.count, shape)
        }
        _ => checkpoint
            .tensor(name)
            .map(|t| vec![t])
            .ok_or_else(|| Error::Model(format!("missing tensor {name}"))),
    }
}

/// The GGUF dimensions of `parts` written as one tensor: experts stacked as the last dimension;
/// a `[1, n]` matrix (Qwen2-MoE's shared expert gate) as the vector llama.cpp stores.
fn stored_dims(parts: &[HostTensor]) -> Vec<usize> {
    match parts {
        [one] => match one.dims {
            [n, 1] => vec![*n],
            dims => dims.to_vec(),
        },
        many => {
            let mut dims = many.first().map_or(Vec::new(), |t| t.dims.to_vec());
            dims.push(many.len());
            dims
        }
    }
}

/// The name a tensor is written under: llama.cpp's Phi-3 keeps its fused gate and up matrix as
/// `ffn_up`, which axiom reads from a checkpoint as `ffn_gate_up`.
fn stored_name(name: &str) -> String {
    name.replace(".ffn_gate_up.", ".ffn_up.")
}

/// The type a matrix with rows of `row` gets when `ty` is asked for.
fn matrix_type(ty: GgmlType, row: usize) -> GgmlType {
    [ty, GgmlType::Q8_0, GgmlType::F32]
        .into_iter()
        .find(|t| row.is_multiple_of(t.block_len()))
        .unwrap_or(GgmlType::F32)
}

/// Every tensor the config calls for, by GGUF name.
fn tensor_names(config: &ModelConfig, untied: bool) -> Vec<String> {
    let mut names = vec!["token_embd.weight".to_string(), "output_norm.weight".to_string()];
    if untied {
        names.push("output.weight".into());
    }
    for i in 0..config.n_layers {
        let mixture = config.experts.as_ref().filter(|e| e.is_mixture(i));
        let mut fields = match config.architecture.as_str() {
            _ if mixture.is_some() => {
                let mut fields = vec![
                    "attn_norm",
                    "attn_q",
                    "attn_k",
                    "attn_v",
                    "attn_output",
                    "ffn_norm",
                    "ffn_gate_inp",
                    "ffn_gate_exps",
                    "ffn_up_exps",
                    "ffn_down_exps",
                ];
                if mixture.is_some_and(|e| e.shared_ffn_dim.is_some()) {
                    fields.extend(["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"]);
                }
                fields
            }
            "phi3" => vec![
                "attn_norm",
                "attn_qkv",
                "attn_output",
                "ffn_norm",
                "ffn_gate_up",
                "ffn_down",
            ],
            _ => vec![
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ],
        };
        if config.qk_norm {
            fields.extend(["attn_q_norm", "attn_k_norm"]);
        }
        if config.post_norms {
            fields.extend(["post_attention_norm", "post_ffw_norm"]);
        }
        names.extend(fields.iter().map(|f| format!("blk.{i}.{f}.weight")));
        if config.qkv_bias {
            names.extend(
                ["attn_q", "attn_k", "attn_v"]
                    .iter()
                    .map(|f| format!("blk.{i}.{f}.bias")),
            );
        }
        if config.o_bias {
            names.push(format!("blk.{i}.attn_output.bias"));
        }
    }
    names
}

/// The sliding window, as llama.cpp's keys hold it: its size, which layers slide (one boolean a
/// layer), and the sliding layers' own rope base where it differs.
fn sliding_metadata(config: &ModelConfig, arch: &str, w: &mut GgufWriter) -> Result<()> {
    let Some(sliding) = &config.sliding else {
        return Ok(());
    };
    w.set(
        &format!("{arch}.attention.sliding_window"),
        Value::U32(sliding.window as u32),
    );
    w.set(
        &format!("{arch}.attention.sliding_window_pattern"),
        Value::Array(sliding.layers.iter().map(|&b| Value::Bool(b)).collect()),
    );
    if let Some(local) = sliding.rope {
        if local.scaling != RopeScaling::None {
            return Err(Error::Model(
                "the sliding layers' rope is scaled: GGUF has no keys for that".into(),
            ));
        }
        w.set(&format!("{arch}.rope.freq_base_swa"), Value::F32(local.theta));
    }
    Ok(())
}

/// Hugging Face orders each head's rotary pairs as halves (i, i + d/2); GGUF's llama as
/// neighbours (2i, 2i+1). Row `h*d + 2j + k` of the result is row `h*d + k*d/2 + j` of `rows`.
fn permute_rows(values: &[f32], heads: usize, n_rows: usize, row_len: usize) -> Vec<f32> {
    let d = n_rows / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for j in 0..d / 2 {
            for k in 0..2 {
                let (dst, src) = (h * d + 2 * j + k, h * d + k * (d / 2) + j);
                out[dst * row_len..(dst + 1) * row_len].copy_from_slice(&values[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

/// The GGUF tokenizer keys of a `tokenizer.json`: byte-level BPE (GGUF's `gpt2`), or
/// SentencePiece-style BPE with byte fallback (GGUF's `llama`: Llama 2, Mistral v0.1-0.3, Gemma).
fn tokenizer_metadata(dir: &Path, w: &mut GgufWriter) -> Result<()> {
    let path = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).map_err(Error::io(format!("reading {}", path.display())))?;
    let json: Json = serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("tokenizer.json: {e}")))?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(Error::Tokenizer(format!(
            "convert writes BPE tokenizers only, not {}",
            model["type"]
        )));
    }
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let n = tokenizer.vocab_size();
    let tokens: Vec<String> = (0..n as u32)
        .map(|i| tokenizer.token_text(i).unwrap_or("").to_owned())
        .collect();
    // GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    let mut types = vec![1i32; n];
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        if let Some(id) = added["id"].as_u64().filter(|&id| (id as usize) < n) {
            types[id as usize] = if added["special"] == true { 3 } else { 4 };
        }
    }
    let merges: Vec<(String, String)> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            Json::String(s) => s.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())),
            Json::Array(pair) => Some((pair.first()?.as_str()?.to_owned(), pair.get(1)?.as_str()?.to_owned())),
            _ => None,
        })
        .collect();
    if model["byte_fallback"] == true {
        sentencepiece_metadata(&json, &tokens, &mut types, &merges, w)?;
    } else {
        w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
        w.set(
            "tokenizer.ggml.pre",
            Value::String(pre_tokenizer_name(&json["pre_tokenizer"])?.into()),
        );
        let merges = merges.iter().map(|(a, b)| Value::String(format!("{a} {b}"))).collect();
        w.set("tokenizer.ggml.merges", Value::Array(merges));
    }
    w.set(
        "tokenizer.ggml.tokens",
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    w.set(
        "tokenizer.ggml.token_type",
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    if let Some(bos) = tokenizer.bos {
        w.set("tokenizer.ggml.bos_token_id", Value::U32(bos));
    }
    if let Some(eos) = tokenizer.eos {
        w.set("tokenizer.ggml.eos_token_id", Value::U32(eos));
    }
    if let Some(eot) = tokenizer
        .end_of_generation_ids()
        .filter(|&id| Some(id) != tokenizer.eos)
        .min()
    {
        w.set("tokenizer.ggml.eot_token_id", Value::U32(eot));
    }
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(tokenizer.add_bos));
    Ok(())
}

/// The `llama` (SentencePiece) keys of a byte-fallback BPE `tokenizer.json`. GGUF keeps a score
/// per piece instead of merges, and the loader ranks a piece's splits by the piece's score: each
/// merged piece scores minus the rank of the first merge that makes it, so the ranking is the
/// file's. Spaces must be "\u{2581}", with or without one prepended.
fn sentencepiece_metadata(
    json: &Json,
    tokens: &[String],
    types: &mut [i32],
    merges: &[(String, String)],
    w: &mut GgufWriter,
) -> Result<()> {
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut scores: Vec<Option<f32>> = vec![None; tokens.len()];
    for (rank, (a, b)) in merges.iter().enumerate() {
        if let Some(&id) = index.get(format!("{a}{b}").as_str()) {
            scores[id].get_or_insert(-(rank as f32) - 1.0);
        }
    }
    for (i, t) in tokens.iter().enumerate() {
        let byte = t.len() == 6 && t.starts_with("<0x") && t.ends_with('>');
        if byte && types[i] == 1 {
            types[i] = 6;
        }
    }
    if let Some(&unk) = json["model"]["unk_token"].as_str().and_then(|u| index.get(u)) {
        types[unk] = 2;
        w.set("tokenizer.ggml.unknown_token_id", Value::U32(unk as u32));
    }
    let scores: Vec<f32> = scores.into_iter().map(|s| s.unwrap_or(0.0)).collect();
    // The loader derives merges from the scores: they must come out as the file's.
    let wide_types: Vec<i64> = types.iter().map(|&t| t as i64).collect();
    let derived = crate::tokenizer::sentencepiece_merges(tokens, &scores, &wide_types);
    let listed = merges.iter().map(|(a, b)| (a.as_str(), b.as_str()));
    if !derived.iter().copied().eq(listed) {
        return Err(Error::Tokenizer(
            "the tokenizer's merges are not a SentencePiece vocabulary's (every split of each piece, by score): \
             GGUF's llama tokenizer cannot hold them"
                .into(),
        ));
    }
    w.set("tokenizer.ggml.model", Value::String("llama".into()));
    w.set(
        "tokenizer.ggml.scores",
        Value::Array(scores.into_iter().map(Value::F32).collect()),
    );
    w.set(
        "tokenizer.ggml.add_space_prefix",
        Value::Bool(sentencepiece_space_prefix(json)?),
    );
    Ok(())
}

/// Whether a SentencePiece-style `tokenizer.json` prepends "\u{2581}" to the text, as its
/// normalizer (`Prepend` and `Replace`, or `Replace` alone) or `Metaspace` pre-tokenizer says.
/// Any other step is refused by name.
fn sentencepiece_space_prefix(json: &Json) -> Result<bool> {
    const SPACE: &str = "\u{2581}";
    let steps = |v: &Json, list: &str| -> Vec<Json> {
        match v["type"].as_str() {
            Some("Sequence") => v[list].as_array().cloned().unwrap_or_default(),
            Some(_) => vec![v.clone()],
            None => vec![],
        }
    };
    let unknown = |what: &str, step: &Json| {
        Error::Tokenizer(format!("the SentencePiece {what} step {step} is not one axiom knows"))
    };
    let mut prefix = false;
    for step in steps(&json["normalizer"], "normalizers") {
        match step["type"].as_str() {
            Some("Prepend") if step["prepend"] == SPACE => prefix = true,
            Some("Replace") if step["pattern"]["String"] == " " && step["content"] == SPACE => {}
            _ => return Err(unknown("normalizer", &step)),
        }
    }
    for step in steps(&json["pre_tokenizer"], "pretokenizers") {
        match step["type"].as_str() {
            Some("Metaspace") if step["replacement"] == SPACE && step["split"] != true => {
                prefix |= step["prepend_scheme"] != "never" && step["add_prefix_space"] != false;
            }
            _ => return Err(unknown("pre-tokenizer", &step)),
        }
    }
    Ok(prefix)
}

/// The `tokenizer.ggml.pre` name of a `tokenizer.json` pre-tokenizer (see tokenizer.rs).
fn pre_tokenizer_name(pre: &Json) -> Result<&'static str> {
    let split_pattern = |p: &Json| p["pattern"]["Regex"].as_str().map(str::to_owned);
    let steps: Vec<&Json> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        Some(_) => vec![pre],
        None => vec![],
    };
    let kinds: Vec<&str> = steps.iter().filter_map(|s| s["type"].as_str()).collect();
    match kinds.as_slice() {
        ["ByteLevel"] if steps[0]["use_regex"] != false => Ok("default"),
        ["Digits", "ByteLevel"] if steps[0]["individual_digits"] == true => Ok("smollm"),
        ["Split", "ByteLevel"] => match split_pattern(steps[0]).as_deref() {
            Some(p) if p == crate::tokenizer::LLAMA3_PATTERN => Ok("llama-bpe"),
            Some(p) if p == crate::tokenizer::QWEN2_PATTERN => Ok("qwen2"),
            _ => Err(Error::Tokenizer(
                "the tokenizer's split pattern is not one axiom knows".into(),
            )),
        },
        _ => Err(Error::Tokenizer(format!(
            "pre-tokenizer {kinds:?} is not one axiom knows"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::permute_rows;

    #[test]
    fn permutation_interleaves_the_halves_of_each_head() {
        // Two heads of dimension 4, rows of length 1: [a0 a1 b0 b1] per head becomes [a0 b0 a1 b1].
        let rows = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0];
        assert_eq!(
            permute_rows(&rows, 2, 8, 1),
            vec![0.0, 10.0, 1.0, 11.0, 20.0, 30.0, 21.0, 31.0]
        );
    }
}
