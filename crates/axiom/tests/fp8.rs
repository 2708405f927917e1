//! Hugging Face FP8 checkpoints on the CPU: the fixtures of scripts/make_hf_fixtures.py against
//! transformers float32 on their dequantized weights, `axiom convert --type fp8` against the
//! fixture quantized in torch, torch's E4M3 codes, and bad files refused by name.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::engine::Session;
use axiom::format::fp8::{decode, encode};
use axiom::model::llama::LoadOptions;
use common::{hf_fixture as fixture, worst_error};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// A checkpoint's tensors, by name, as `SafeTensors::tensors` lists them.
type Tensors<'a> = Vec<(String, TensorView<'a>)>;

/// A fresh temporary directory named after `what`.
fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("axiom-fp8-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A copy of the fixture `name` in `dir`, its config changed by `edit`.
fn copy_with_config(name: &str, dir: &Path, edit: impl FnOnce(&mut Value)) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn load_error(dir: &Path) -> String {
    let options = LoadOptions {
        max_batch: 8,
        kv_tokens: 8,
        max_seqs: 1,
    };
    Session::load(dir, CpuBackend::new(1), options)
        .err()
        .unwrap()
        .to_string()
}

#[test]
fn fbgemm_fp8_reads_the_same_per_channel_scales() {
    let dir = temp_dir("fbgemm");
    copy_with_config("llama_fp8_channel", &dir, |c| {
        c["quantization_config"] = json!({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                          "modules_to_not_convert": ["lm_head"]});
    });
    let err = worst_error(&dir, &fixture("llama_fp8_channel"), CpuBackend::reference(2));
    assert!(err < 1e-4, "relative L2 error {err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn convert_to_fp8_writes_what_torch_quantizes_and_runs_like_it() {
    let out = temp_dir("convert");
    axiom::convert_fp8::convert_to_fp8(&fixture("qwen3_fp8_source"), &out, |_, _, _| {}).unwrap();
    let (ours, torch) = (
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(fixture("qwen3_fp8").join("model.safetensors")).unwrap(),
    );
    let (ours, torch) = (
        SafeTensors::deserialize(&ours).unwrap(),
        SafeTensors::deserialize(&torch).unwrap(),
    );
    let mut names = ours.names();
    names.sort_unstable();
    let mut want = torch.names();
    want.sort_unstable();
    assert_eq!(names, want);
    for name in names {
        let (a, b) = (ours.tensor(name).unwrap(), torch.tensor(name).unwrap());
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert!(a.data() == b.data(), "{name}: bytes differ from torch's");
    }
    let config = |dir: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(
        config(&out)["quantization_config"],
        config(&fixture("qwen3_fp8"))["quantization_config"]
    );
    let err = worst_error(&out, &fixture("qwen3_fp8"), CpuBackend::reference(2));
    assert!(err < 1e-4, "relative L2 error {err}");
    // An FP8 directory is not converted again, and nothing is written over.
    let again = temp_dir("convert-again");
    let err = axiom::convert_fp8::convert_to_fp8(&out, &again, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("already quantized"), "{err}");
    let err = axiom::convert_fp8::convert_to_fp8(&fixture("qwen3_fp8_source"), &out, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("not empty"), "{err}");
    std::fs::remove_dir_all(out).unwrap();
    // A model none of whose matrices is whole 128 x 128 blocks has nothing to convert.
    let none = temp_dir("convert-none");
    let err = axiom::convert_fp8::convert_to_fp8(&fixture("llama"), &none, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("none converts to FP8"), "{err}");
    assert!(!none.exists(), "{} was created", none.display());
}

#[test]
fn an_fp8_directory_converts_to_gguf_through_its_dequantized_weights() {
    let dir = temp_dir("gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("qwen3_fp8.gguf");
    axiom::convert::convert_hf_dir(
        &fixture("qwen3_fp8"),
        &out,
        axiom::format::quant::GgmlType::F32,
        |_, _, _| {},
    )
    .unwrap();
    let err = worst_error(&out, &fixture("qwen3_fp8"), CpuBackend::reference(2));
    assert!(err < 1e-4, "relative L2 error {err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn e4m3_codes_match_torch_float8_e4m3fn() {
    let table: Value = serde_json::from_str(&std::fs::read_to_string(fixture("../fp8_e4m3.json")).unwrap()).unwrap();
    let values = table["value_bits"].as_array().unwrap();
    assert_eq!(values.len(), 256);
    for (code, bits) in values.iter().enumerate() {
        let want = f32::from_bits(bits.as_i64().unwrap() as u32);
        let got = decode(code as u8);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "code {code:#04x}: {got} vs torch's {want}"
        );
    }
    let probes = table["encode"].as_array().unwrap();
    assert!(probes.len() > 1000);
    for probe in probes {
        let x = f32::from_bits(probe[0].as_i64().unwrap() as u32);
        let want = probe[1].as_u64().unwrap() as u8;
        assert_eq!(encode(x), want, "{x:e}: {:#04x} vs torch's {want:#04x}", encode(x));
    }
}

#[test]
fn bad_fp8_files_are_refused_by_name() {
    let dir = temp_dir("bad");
    let refused = |edit: &dyn Fn(&mut Value), wanted: &str| {
        copy_with_config("qwen3_fp8", &dir, edit);
        let err = load_error(&dir);
        assert!(err.contains(wanted), "wanted {wanted:?} in: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    };
    let q = |key: &'static str, value: Value| move |c: &mut Value| c["quantization_config"][key] = value.clone();
    refused(&q("weight_block_size", json!([64, 64])), "weight_block_size");
    refused(&q("quant_method", json!("awq")), "quant_method \"awq\"");
    refused(&q("activation_scheme", json!("static")), "activation_scheme \"static\"");
    refused(&q("fmt", json!("e5m2")), "fmt");
    refused(&q("kv_cache_scheme", json!({})), "kv_cache_scheme");
    refused(
        &|c: &mut Value| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
        "is F8_E4M3, but config.json has no quantization_config",
    );
    // Per-channel scales named for a block-wise checkpoint: each weight misses its scales.
    refused(
        &|c: &mut Value| {
            c["quantization_config"] = json!({"quant_method": "fbgemm_fp8"});
        },
        "_scale (the scales of FP8",
    );

    // The checkpoint rewritten: without one scale, with a scale of the wrong shape, in E5M2,
    // with a static input scale.
    static ONE: [u8; 4] = 1f32.to_le_bytes();
    let single = TensorView::new(safetensors::Dtype::F32, vec![1], &ONE).unwrap();
    // 'static, as the edits' tensors must be (they are handed to an edit for any lifetime).
    let original: &'static [u8] = std::fs::read(fixture("qwen3_fp8").join("model.safetensors"))
        .unwrap()
        .leak();
    let rewritten = |edit: &dyn Fn(&mut Tensors), wanted: &str| {
        copy_with_config("qwen3_fp8", &dir, |_| {});
        let checkpoint = SafeTensors::deserialize(original).unwrap();
        let mut tensors = checkpoint.tensors();
        edit(&mut tensors);
        safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
        let err = load_error(&dir);
        assert!(err.contains(wanted), "wanted {wanted:?} in: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    };
    let scale = "model.layers.1.mlp.down_proj.weight_scale_inv";
    rewritten(&|t| t.retain(|(n, _)| n != scale), &format!("missing tensor {scale}"));
    rewritten(
        &|t| {
            t.retain(|(n, _)| n != scale);
            t.push((scale.to_string(), single.clone()));
        },
        &format!("tensor {scale} has shape [1]"),
    );
    // The other 8-bit float formats are named.
    let weight = "model.layers.0.self_attn.q_proj.weight";
    let codes = SafeTensors::deserialize(original).unwrap().tensor(weight).unwrap();
    let e5m2 = TensorView::new(safetensors::Dtype::F8_E5M2, codes.shape().to_vec(), codes.data()).unwrap();
    rewritten(
        &|t| {
            t.retain(|(n, _)| n != weight);
            t.push((weight.to_string(), e5m2.clone()));
        },
        "has type F8_E5M2",
    );
    let input_scale = "model.layers.0.self_attn.q_proj.input_scale";
    rewritten(
        &|t| t.push((input_scale.to_string(), single.clone())),
        &format!("does not use: {input_scale}"),
    );
}

/// The last token's logits of `text` from the model in `dir`, on the reference CPU backend.
fn last_logits(dir: &Path, text: &str) -> Vec<f32> {
    let options = LoadOptions {
        max_batch: 64,
        kv_tokens: 64,
        max_seqs: 1,
    };
    let mut s = Session::load(dir, CpuBackend::reference(1), options).unwrap();
    let mut kv = s.model.new_kv_cache(64);
    let tokens = s.raw_prompt(text).unwrap();
    s.forward_last(&tokens, &mut kv).unwrap().to_vec()
}

#[test]
fn a_scale_per_matrix_scales_every_weight_of_it() {
    // The channel fixture's codes with each matrix's first channel scale for the whole matrix
    // (compressed-tensors' "tensor" strategy), against the same weights dequantized here with
    // torch's E4M3 values and stored as F32.
    let table: Value = serde_json::from_str(&std::fs::read_to_string(fixture("../fp8_e4m3.json")).unwrap()).unwrap();
    let values: Vec<f32> = table["value_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_i64().unwrap() as u32))
        .collect();
    let original = std::fs::read(fixture("llama_fp8_channel").join("model.safetensors")).unwrap();
    let checkpoint = SafeTensors::deserialize(&original).unwrap();
    let scale_of = |name: &str| {
        let bytes = checkpoint.tensor(&format!("{name}_scale")).unwrap().data()[..4].to_vec();
        (f32::from_le_bytes(bytes.clone().try_into().unwrap()), bytes)
    };
    let fp8_names: Vec<String> = checkpoint
        .tensors()
        .into_iter()
        .filter(|(_, t)| t.dtype() == safetensors::Dtype::F8_E4M3)
        .map(|(n, _)| n)
        .collect();
    let scales: Vec<(String, (f32, Vec<u8>))> = fp8_names.iter().map(|n| (n.clone(), scale_of(n))).collect();
    let dequantized: Vec<(String, Vec<u8>)> = scales
        .iter()
        .map(|(n, (scale, _))| {
            let codes = checkpoint.tensor(n).unwrap();
            let bytes = codes
                .data()
                .iter()
                .flat_map(|&c| (values[c as usize] * scale).to_le_bytes())
                .collect();
            (n.clone(), bytes)
        })
        .collect();

    let per_matrix = temp_dir("per-matrix");
    copy_with_config("llama_fp8_channel", &per_matrix, |c| {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = json!("tensor");
    });
    let mut tensors: Tensors = checkpoint
        .tensors()
        .into_iter()
        .filter(|(n, _)| !n.ends_with("_scale"))
        .collect();
    for (n, (_, bytes)) in &scales {
        tensors.push((
            format!("{n}_scale"),
            TensorView::new(safetensors::Dtype::F32, vec![1], bytes).unwrap(),
        ));
    }
    safetensors::serialize_to_file(tensors, None, &per_matrix.join("model.safetensors")).unwrap();

    let float = temp_dir("per-matrix-f32");
    copy_with_config("llama_fp8_channel", &float, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let mut tensors: Tensors = checkpoint
        .tensors()
        .into_iter()
        .filter(|(n, t)| !n.ends_with("_scale") && t.dtype() != safetensors::Dtype::F8_E4M3)
        .collect();
    for (n, bytes) in &dequantized {
        let shape = checkpoint.tensor(n).unwrap().shape().to_vec();
        tensors.push((
            n.clone(),
            TensorView::new(safetensors::Dtype::F32, shape, bytes).unwrap(),
        ));
    }
    safetensors::serialize_to_file(tensors, None, &float.join("model.safetensors")).unwrap();

    for text in ["The license applies", "Copyright 2004"] {
        let (got, want) = (last_logits(&per_matrix, text), last_logits(&float, text));
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "{text:?}: largest difference {worst}");
    }
    std::fs::remove_dir_all(per_matrix).unwrap();
    std::fs::remove_dir_all(float).unwrap();
}
