//! `axiom convert`: the GGUF it writes from each Hugging Face fixture runs like the original.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::convert::convert_hf_dir;
use axiom::format::gguf::GgufFile;
use axiom::format::quant::GgmlType;
use axiom::tokenizer::Tokenizer;
use common::{hf_fixture, worst_error};

#[test]
fn converted_gguf_files_match_transformers() {
    let dir = std::env::temp_dir().join(format!("axiom-convert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for &name in common::HF_FIXTURES.iter().chain(common::MOE_FIXTURES) {
        // f32: the same numbers, in GGUF's layout (Q/K rows permuted for llama).
        let out = dir.join(format!("{name}-f32.gguf"));
        convert_hf_dir(&hf_fixture(name), &out, GgmlType::F32, |_, _, _| {}).unwrap();
        let err = worst_error(&out, &hf_fixture(name), CpuBackend::reference(2));
        assert!(err < 1e-4, "{name} f32 GGUF: relative L2 error {err}");
        // Quantized: 8-bit weights move the logits a little, never wildly.
        let out = dir.join(format!("{name}-q8_0.gguf"));
        convert_hf_dir(&hf_fixture(name), &out, GgmlType::Q8_0, |_, _, _| {}).unwrap();
        let err = worst_error(&out, &hf_fixture(name), CpuBackend::reference(2));
        // Phi-3's LongRoPE attention factor squared multiplies the attention logits, and with
        // them the weights' rounding error. In a mixture, rounding can tip a token near a tie to
        // another expert, which moves its logits by a whole expert's output.
        let tolerance = match name {
            "phi3" => 0.08,
            "mixtral" => 0.1,
            "qwen3_moe" => 0.2,
            _ => 0.05,
        };
        assert!(err < tolerance, "{name} Q8_0 GGUF: relative L2 error {err}");
        // The experts of the fast backend (8-bit activations, an f16 cache): slices of the stacked
        // tensors, repacked one by one. Qwen2-MoE's weights, not renormalized, move little where a
        // token flips to another expert, so it holds the fast backend to the dense models' bound.
        if name == "qwen2_moe" {
            let err = worst_error(&out, &hf_fixture(name), CpuBackend::new(2));
            assert!(
                err < tolerance,
                "{name} Q8_0 GGUF, fast backend: relative L2 error {err}"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn converted_tokenizers_encode_and_decode_as_the_originals() {
    let license = std::fs::read_to_string(common::refs("apache-2.0.txt")).unwrap();
    let mut texts: Vec<&str> = license.lines().collect();
    texts.extend([
        "",
        " ",
        "  two  spaces and a tab\there",
        "\n\nnewlines\n",
        "caf\u{e9} \u{fc}ber \u{65e5}\u{672c} \u{1f642} bytes the vocabulary lacks",
        "<s>special</s> text",
        // After an added token each run gets its own "▁", even one that starts with a space,
        // as llama.cpp gives it (its llama-tokenize agrees on these three).
        "hello</s>world",
        "</s> world",
        "<s>hi</s>  x",
        "1234567890",
    ]);
    let dir = std::env::temp_dir().join(format!("axiom-convert-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Byte-level BPE, and SentencePiece BPE with byte fallback (Llama 2's layout).
    for name in ["llama", "llama_spm"] {
        let out = dir.join(format!("{name}.gguf"));
        convert_hf_dir(&hf_fixture(name), &out, GgmlType::F32, |_, _, _| {}).unwrap();
        let ours = Tokenizer::from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
        let theirs = Tokenizer::from_hf_dir(&hf_fixture(name)).unwrap();
        assert_eq!(
            (ours.bos, ours.eos, ours.add_bos),
            (theirs.bos, theirs.eos, theirs.add_bos),
            "{name}"
        );
        for text in &texts {
            for special in [false, true] {
                let ids = theirs.encode(text, special, true).unwrap();
                assert_eq!(ours.encode(text, special, true).unwrap(), ids, "{name}: {text:?}");
                assert_eq!(
                    ours.decode(&ids, false).unwrap(),
                    theirs.decode(&ids, false).unwrap(),
                    "{name}: {text:?}"
                );
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unsupported_targets_are_refused() {
    let out = std::env::temp_dir().join(format!("axiom-convert-bad-{}.gguf", std::process::id()));
    let err = convert_hf_dir(&hf_fixture("llama"), &out, GgmlType::Q3K, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("Q3_K"), "{err}");
    assert!(!out.exists());
}

#[test]
fn matrices_whose_rows_do_not_fit_the_type_are_reported_as_written() {
    let dir = std::env::temp_dir().join(format!("axiom-convert-fallback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f32 = convert_hf_dir(&hf_fixture("llama"), &dir.join("f32.gguf"), GgmlType::F32, |_, _, _| {}).unwrap();
    let q4k = convert_hf_dir(
        &hf_fixture("llama"),
        &dir.join("q4_k.gguf"),
        GgmlType::Q4K,
        |_, _, _| {},
    )
    .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    let n: usize = f32.matrices.iter().map(|&(_, n)| n).sum();
    assert!(n > 0 && f32.vectors > 0, "{f32:?}");
    assert_eq!(f32.matrices, vec![(GgmlType::F32, n)]);
    // The fixture's rows of 64 and 128 values fit no Q4_K block of 256: every matrix is Q8_0.
    assert_eq!(q4k.matrices, vec![(GgmlType::Q8_0, n)]);
    assert_eq!(q4k.vectors, f32.vectors);
}

#[test]
fn yarn_without_truncation_is_refused_as_llama_cpp_cannot_say_it() {
    let dir = std::env::temp_dir().join(format!("axiom-convert-yarn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(hf_fixture("qwen2_yarn")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["rope_parameters"]["truncate"] = false.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let out = dir.join("out.gguf");
    let err = convert_hf_dir(&dir, &out, GgmlType::F32, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("truncate"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn experts_are_written_stacked_under_llama_cpp_names() {
    let dir = std::env::temp_dir().join(format!("axiom-convert-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // (fixture, GGUF architecture, experts, shared expert width)
    for (name, arch, experts, shared) in [
        ("qwen3_moe", "qwen3moe", 6, None),
        ("mixtral", "llama", 8, None),
        ("qwen2_moe", "qwen2moe", 6, Some(96)),
    ] {
        let out = dir.join(format!("{name}.gguf"));
        convert_hf_dir(&hf_fixture(name), &out, GgmlType::Q8_0, |_, _, _| {}).unwrap();
        let f = GgufFile::open(&out).unwrap();
        assert_eq!(f.get("general.architecture").unwrap().as_str(), Some(arch));
        assert_eq!(f.get_usize(&format!("{arch}.expert_count")).unwrap(), Some(experts));
        assert_eq!(f.get_usize(&format!("{arch}.expert_used_count")).unwrap(), Some(2));
        assert_eq!(
            f.get_usize(&format!("{arch}.expert_shared_feed_forward_length"))
                .unwrap(),
            shared
        );
        let t = |n: &str| f.tensor(n).unwrap_or_else(|| panic!("{name}: no {n}"));
        // Experts stacked as the last dimension, quantized; the router left in F32.
        let gate = t("blk.0.ffn_gate_exps.weight");
        assert_eq!((gate.ty, gate.dims.clone()), (GgmlType::Q8_0, vec![64, 48, experts]));
        assert_eq!(t("blk.0.ffn_down_exps.weight").dims, vec![48, 64, experts]);
        let router = t("blk.0.ffn_gate_inp.weight");
        assert_eq!((router.ty, router.dims.clone()), (GgmlType::F32, vec![64, experts]));
        if shared.is_some() {
            assert_eq!(t("blk.0.ffn_gate_inp_shexp.weight").dims, vec![64]);
            assert_eq!(t("blk.0.ffn_down_shexp.weight").dims, vec![96, 64]);
        }
    }
    // qwen3_moe's dense middle layer keeps the dense names.
    let f = GgufFile::open(&dir.join("qwen3_moe.gguf")).unwrap();
    assert!(f.tensor("blk.1.ffn_gate.weight").is_some() && f.tensor("blk.1.ffn_gate_inp.weight").is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn gguf_experts_follow_llama_cpp_where_keys_are_missing_and_odd_gating_is_refused() {
    use axiom::format::gguf::Value;
    use axiom::format::gguf_writer::GgufWriter;
    use axiom::model::ModelConfig;
    let dir = std::env::temp_dir().join(format!("axiom-convert-moe-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The converted file of `name` with `key` set to `value` (or dropped), its config read back.
    let config_with = |name: &str, key: &str, value: Option<Value>| {
        let converted = dir.join(format!("{name}.gguf"));
        convert_hf_dir(&hf_fixture(name), &converted, GgmlType::F32, |_, _, _| {}).unwrap();
        let f = GgufFile::open(&converted).unwrap();
        let mut w = GgufWriter::default();
        for (k, v) in f.metadata.iter().filter(|(k, _)| k != key) {
            w.set(k, v.clone());
        }
        if let Some(v) = value {
            w.set(key, v);
        }
        for t in &f.tensors {
            w.tensor(&t.name, t.ty, &t.dims, f.tensor_bytes(t).to_vec()).unwrap();
        }
        let edited = dir.join(format!("{name}-edited.gguf"));
        w.write(&edited).unwrap();
        ModelConfig::from_gguf(&GgufFile::open(&edited).unwrap())
    };
    // Without `expert_weights_norm`, llama.cpp renormalizes Qwen3-MoE's and Mixtral's weights,
    // not Qwen2-MoE's.
    for (name, key, renormalized) in [
        ("qwen3_moe", "qwen3moe.expert_weights_norm", true),
        ("mixtral", "llama.expert_weights_norm", true),
        ("qwen2_moe", "qwen2moe.expert_weights_norm", false),
    ] {
        let experts = config_with(name, key, None).unwrap().experts.unwrap();
        assert_eq!(experts.renormalize, renormalized, "{name}");
    }
    // A layer is a mixture where it has a router.
    let experts = config_with("qwen3_moe", "qwen3moe.expert_weights_norm", None)
        .unwrap()
        .experts
        .unwrap();
    assert_eq!(experts.layers, vec![true, false, true]);
    for (key, value, refused) in [
        ("qwen3moe.expert_gating_func", Value::U32(2), "expert_gating_func 2"),
        (
            "qwen3moe.expert_weights_scale",
            Value::F32(2.5),
            "expert_weights_scale 2.5",
        ),
        ("qwen3moe.expert_used_count", Value::U32(7), "6 experts of 7 a token"),
    ] {
        let err = config_with("qwen3_moe", key, Some(value)).unwrap_err().to_string();
        assert!(err.contains(refused), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_token_reads_only_its_share_of_the_experts() {
    use axiom::engine::Session;
    use axiom::model::llama::LoadOptions;
    let options = LoadOptions {
        max_batch: 8,
        kv_tokens: 16,
        max_seqs: 1,
    };
    let out = std::env::temp_dir().join(format!("axiom-convert-moe-bytes-{}.gguf", std::process::id()));
    convert_hf_dir(&hf_fixture("qwen3_moe"), &out, GgmlType::F32, |_, _, _| {}).unwrap();
    let gguf = Session::load(&out, CpuBackend::new(1), options).unwrap().info;
    let hf = Session::load(&hf_fixture("qwen3_moe"), CpuBackend::new(1), options)
        .unwrap()
        .info;
    std::fs::remove_file(&out).unwrap();
    // Two mixture layers of six experts, each three F32 matrices of 64 x 48; a token runs two.
    let experts = 2 * 6 * 3 * 64 * 48 * 4;
    let every_matrix: usize = hf.parameters * 4 - {
        // The norms, the only vectors: two a layer, Q/K norms of 32, the final norm.
        (3 * (2 * 64 + 2 * 32) + 64) * 4
    };
    // Nor does it read the embedding table as a matrix: the LM head is its own.
    let embedding = 1000 * 64 * 4;
    assert_eq!(hf.weight_bytes_per_token, every_matrix - embedding - experts * 4 / 6);
    assert_eq!(gguf.weight_bytes_per_token, hf.weight_bytes_per_token);
}
