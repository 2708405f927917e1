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
    axiom::convert_fp8::convert_to_fp8(&fixture("qwen3_fp8_source"), &out, 128, |_, _, _| {}).unwrap();
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
    let err = axiom::convert_fp8::convert_to_fp8(&out, &again, 128, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("already quantized"), "{err}");
    let err = axiom::convert_fp8::convert_to_fp8(&fixture("qwen3_fp8_source"), &out, 128, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("not empty"), "{err}");
    std::fs::remove_dir_all(out).unwrap();
    // A model none of whose matrices is whole blocks has nothing to convert: the refusal names
    // the smaller blocks that would. Block sizes transformers cannot run are refused.
    let none = temp_dir("convert-none");
    for (block, wanted) in [
        (
            128,
            "no layer matrix is whole 128x128 blocks, so none converts to FP8; --fp8-block 64 or 32 fits",
        ),
        (
            256,
            "no layer matrix is whole 256x256 blocks, so none converts to FP8; --fp8-block 64 or 32 fits",
        ),
        (48, "FP8 block size 48 is not supported (a power of two, 32 or more)"),
        (16, "FP8 block size 16 is not supported"),
    ] {
        let err = axiom::convert_fp8::convert_to_fp8(&fixture("llama"), &none, block, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains(wanted), "{block}: {err}");
        assert!(!none.exists(), "{} was created", none.display());
    }
}

/// torch's `float8_e4m3fn` value of every code (fixtures/fp8_e4m3.json).
fn torch_e4m3_values() -> Vec<f32> {
    let table: Value = serde_json::from_str(&std::fs::read_to_string(fixture("../fp8_e4m3.json")).unwrap()).unwrap();
    table["value_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_i64().unwrap() as u32))
        .collect()
}

/// A tensor's values as f32, from F32, BF16 or F8_E4M3 (those without scales).
fn values(t: &TensorView) -> Vec<f32> {
    match t.dtype() {
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        safetensors::Dtype::BF16 => t
            .data()
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
        other => panic!("{other:?} is not a float type"),
    }
}

/// The block-wise FP8 directory `fp8` written to `out` as a float one: each FP8 weight times its
/// scale as transformers' FP8 dequantization takes it (torch's E4M3 values, a block the matrix's
/// rows and columns over its scale grid's), stored as F32; everything else as it is.
fn dequantized_copy(fp8: &Path, out: &Path) {
    let e4m3 = torch_e4m3_values();
    std::fs::create_dir_all(out).unwrap();
    for entry in std::fs::read_dir(fp8).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(fp8.join("model.safetensors")).unwrap();
    let checkpoint = SafeTensors::deserialize(&bytes).unwrap();
    let mut dequantized: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in checkpoint.tensors() {
        if t.dtype() != safetensors::Dtype::F8_E4M3 {
            continue;
        }
        let scales = values(&checkpoint.tensor(&format!("{name}_scale_inv")).unwrap());
        let (&[rows, cols], &[grid_rows, grid_cols]) = (
            t.shape(),
            checkpoint.tensor(&format!("{name}_scale_inv")).unwrap().shape(),
        ) else {
            panic!("{name}: not a matrix with a grid of scales");
        };
        let (block_rows, block_cols) = (rows / grid_rows, cols / grid_cols);
        let data = t
            .data()
            .iter()
            .enumerate()
            .flat_map(|(i, &code)| {
                let scale = scales[i / cols / block_rows * grid_cols + i % cols / block_cols];
                (e4m3[code as usize] * scale).to_le_bytes()
            })
            .collect();
        dequantized.push((name, t.shape().to_vec(), data));
    }
    let mut tensors: Tensors = checkpoint
        .tensors()
        .into_iter()
        .filter(|(n, t)| !n.ends_with("_scale_inv") && t.dtype() != safetensors::Dtype::F8_E4M3)
        .collect();
    for (name, shape, data) in &dequantized {
        tensors.push((
            name.clone(),
            TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap(),
        ));
    }
    safetensors::serialize_to_file(tensors, None, &out.join("model.safetensors")).unwrap();
}

/// The tensors of the checkpoint in `dir` (one file or shards), as f32 by name.
fn float_tensors(dir: &Path) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut all = std::collections::HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            for (name, t) in SafeTensors::deserialize(&bytes).unwrap().tensors() {
                all.insert(name, (t.shape().to_vec(), values(&t)));
            }
        }
    }
    all
}

#[test]
fn convert_to_fp8_in_smaller_blocks_runs_as_its_dequantized_weights() {
    // (the source, the block, the matrices left as stored for not being whole blocks)
    let cases: [(&str, usize, &[&str]); 3] = [
        ("qwen3_fp8_source", 64, &[]),
        ("qwen3_fp8_source", 32, &[]),
        // The Llama fixture's K and V are 32 x 64.
        ("llama", 64, &["k_proj", "v_proj"]),
    ];
    for (source, block, not_whole) in cases {
        let what = format!("{source} in {block}x{block} blocks");
        let out = temp_dir(&format!("blocks-{block}"));
        axiom::convert_fp8::convert_to_fp8(&fixture(source), &out, block, |_, _, _| {}).unwrap();
        let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        let q = &config["quantization_config"];
        assert_eq!(q["weight_block_size"], json!([block, block]), "{what}");

        // Every layer matrix of whole blocks in E4M3 with a scale per block that puts the
        // block's largest weight on 448, each weight within E4M3's rounding of the source's.
        let (original, bytes) = (
            float_tensors(&fixture(source)),
            std::fs::read(out.join("model.safetensors")).unwrap(),
        );
        let converted = SafeTensors::deserialize(&bytes).unwrap();
        let e4m3 = torch_e4m3_values();
        let mut kept = Vec::new();
        for (name, (shape, w)) in &original {
            let t = converted.tensor(name).unwrap();
            if !(name.starts_with("model.layers.") && shape.len() == 2) {
                continue;
            }
            if t.dtype() != safetensors::Dtype::F8_E4M3 {
                kept.push(name.trim_end_matches(".weight").to_string());
                continue;
            }
            let (n_out, n_in) = (shape[0], shape[1]);
            let scale_tensor = converted.tensor(&format!("{name}_scale_inv")).unwrap();
            assert_eq!(scale_tensor.shape(), [n_out / block, n_in / block], "{what}: {name}");
            let scales = values(&scale_tensor);
            let mut largest = vec![0f32; scales.len()];
            for (i, (&code, &v)) in t.data().iter().zip(w).enumerate() {
                let at = i / n_in / block * (n_in / block) + i % n_in / block;
                let got = e4m3[code as usize] * scales[at];
                largest[at] = largest[at].max(e4m3[code as usize].abs());
                assert!(
                    (got - v).abs() <= v.abs() / 16.0 + scales[at] / 1024.0,
                    "{what}: {name}[{i}]: {got} vs {v}"
                );
            }
            assert!(largest.iter().all(|&m| m == 448.0), "{what}: {name}");
        }
        kept.sort_unstable();
        let mut listed: Vec<String> = serde_json::from_value(q["modules_to_not_convert"].clone()).unwrap();
        listed.retain(|m| m != "lm_head");
        listed.sort_unstable();
        assert_eq!(listed, kept, "{what}");
        // Those of both layers.
        assert!(
            kept.iter().all(|m| not_whole.iter().any(|n| m.ends_with(n))) && kept.len() == 2 * not_whole.len(),
            "{what}: {kept:?}"
        );

        // It runs as its weights dequantized as transformers does.
        let float = temp_dir(&format!("blocks-{block}-f32"));
        dequantized_copy(&out, &float);
        for text in ["The license applies", "Copyright 2004"] {
            let (got, want) = (last_logits(&out, text), last_logits(&float, text));
            let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-4, "{what}, {text:?}: largest difference {worst}");
        }
        std::fs::remove_dir_all(out).unwrap();
        std::fs::remove_dir_all(float).unwrap();
    }
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
    // Other blocks are read where they are whole 32-value blocks of a row, the matrices whole
    // blocks of them, and the scales their grid.
    refused(
        &q("weight_block_size", json!([64, 40])),
        "weight_block_size [64,40] is not supported",
    );
    refused(
        &q("weight_block_size", json!([256, 128])),
        "is not whole 256x128 blocks",
    );
    refused(&q("weight_block_size", json!([64, 64])), "_scale_inv has shape");
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
    let values = torch_e4m3_values();
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
