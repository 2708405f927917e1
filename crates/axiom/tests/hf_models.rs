//! Hugging Face model directories of every supported architecture (tiny random models written by
//! scripts/make_hf_fixtures.py with transformers 5.17; the `_bias` and mixture-of-experts ones with 5.25) against
//! transformers' float32 logits.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::engine::Session;
use axiom::model::llama::LoadOptions;
use common::{hf_fixture as fixture, worst_error};

#[test]
fn every_architecture_matches_transformers_in_f32() {
    // The FP8 checkpoints' reference is transformers on their dequantized weights.
    let fixtures = common::HF_FIXTURES
        .iter()
        .chain(common::MOE_FIXTURES)
        .chain(common::FP8_FIXTURES);
    for &name in fixtures {
        let reference = worst_error(&fixture(name), &fixture(name), CpuBackend::reference(2));
        assert!(
            reference < 1e-4,
            "{name}, reference backend: relative L2 error {reference}"
        );
        // F32 weights take the fast backend's float kernels: the same arithmetic, other order.
        let fast = worst_error(
            &fixture(name),
            &fixture(name),
            CpuBackend::new(2).with_kv_type(axiom::backend::KvType::F32),
        );
        assert!(fast < 1e-4, "{name}, fast backend: relative L2 error {fast}");
    }
}

#[test]
fn sequences_longer_than_the_cache_run_behind_an_every_layer_window() {
    // mistral_window slides a window of 4 over every layer: a cache of three pages holds any
    // length, and gives what a roomy one gives.
    let greedy = |kv_tokens: usize| {
        let options = LoadOptions {
            max_batch: 64,
            kv_tokens,
            max_seqs: 1,
        };
        let mut s = Session::load(&fixture("mistral_window"), CpuBackend::reference(1), options).unwrap();
        let mut kv = s.model.new_kv_cache(240);
        let mut tokens = s.raw_prompt("The license applies").unwrap();
        let mut next = tokens.clone();
        while tokens.len() < 240 {
            let logits = s.forward_last(&next, &mut kv).unwrap();
            let best = axiom::backend::cpu::kernels::argmax::argmax(logits);
            tokens.push(best);
            next = vec![best];
        }
        assert!(s.pages.usage().used <= 3, "{:?}", s.pages.usage());
        tokens
    };
    assert_eq!(greedy(48), greedy(512));
}

#[test]
fn greedy_decode_matches_host_argmax() {
    common::gpu::greedy_decode_matches_host_argmax(CpuBackend::new(2));
}

#[test]
fn configs_that_change_the_math_are_refused() {
    use axiom::model::ModelConfig;
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama").join("config.json")).unwrap()).unwrap();
    let with = |key: &str, value: serde_json::Value| {
        let mut c = base.clone();
        c[key] = value;
        ModelConfig::from_hf(&c)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(with("model_type", "gpt_neox".into()).contains("gpt_neox"));
    assert!(with("hidden_act", "gelu".into()).contains("gelu"));
    assert!(with("mlp_bias", true.into()).contains("mlp_bias"));
    // Dynamic NTK rescales by each forward pass's length, which cached keys cannot follow.
    assert!(with(
        "rope_parameters",
        serde_json::json!({"rope_type": "dynamic", "factor": 4.0})
    )
    .contains("dynamic"));
    assert!(with("rope_parameters", serde_json::json!({"rope_type": "longrope"})).contains("short_factor"));
    // Only Phi-3 rotates part of each head.
    assert!(with("partial_rotary_factor", 0.5.into()).contains("partial_rotary_factor"));
    assert!(with("num_key_value_heads", 3.into()).contains("grouped"));
    assert!(with("use_bidirectional_attention", true.into()).contains("use_bidirectional_attention"));
    assert!(with("model_type", "gemma3".into()).contains("vision"));
    assert!(ModelConfig::from_hf(&base).is_ok());
}

#[test]
fn mixture_configs_are_read_per_family_and_bad_ones_refused() {
    use axiom::model::ModelConfig;
    let config = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap()
    };
    let experts = |c: &serde_json::Value| ModelConfig::from_hf(c).unwrap().experts.unwrap();
    // qwen3_moe's middle layer is in `mlp_only_layers`; Mixtral always renormalizes.
    let qwen3 = experts(&config("qwen3_moe"));
    assert_eq!((qwen3.count, qwen3.used, qwen3.ffn_dim), (6, 2, 48));
    assert_eq!(
        (qwen3.layers.clone(), qwen3.renormalize),
        (vec![true, false, true], true)
    );
    let mixtral = experts(&config("mixtral"));
    assert_eq!(
        (mixtral.count, mixtral.renormalize, mixtral.shared_ffn_dim),
        (8, true, None)
    );
    let qwen2 = experts(&config("qwen2_moe"));
    assert_eq!((qwen2.renormalize, qwen2.shared_ffn_dim), (false, Some(96)));
    // Every second layer a mixture under `decoder_sparse_step`.
    let mut c = config("qwen2_moe");
    c["decoder_sparse_step"] = 2.into();
    assert_eq!(experts(&c).layers, vec![false, true]);
    let refused = |name: &str, key: &str, value: serde_json::Value| {
        let mut c = config(name);
        c[key] = value;
        ModelConfig::from_hf(&c)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let mut windowed = config("qwen3_moe");
    windowed["sliding_window"] = 4.into();
    windowed["use_sliding_window"] = true.into();
    let err = ModelConfig::from_hf(&windowed).unwrap_err().to_string();
    assert!(err.contains("use_sliding_window"), "{err}");
    assert!(refused("qwen2_moe", "decoder_sparse_step", 0.into()).contains("decoder_sparse_step"));
    assert!(refused("mixtral", "num_experts_per_tok", 9.into()).contains("8 experts of 9 a token"));
    assert!(refused("qwen2_moe", "mlp_only_layers", "all".into()).contains("mlp_only_layers"));
}

#[test]
fn chat_templates_and_end_of_generation_come_from_the_directory() {
    let s = Session::load(
        &fixture("qwen2"),
        CpuBackend::new(1),
        LoadOptions {
            max_batch: 8,
            kv_tokens: 8,
            max_seqs: 1,
        },
    )
    .unwrap();
    let prompt = s.chat_prompt(&[axiom::chat::Message::new("user", "hi")]).unwrap();
    let im_start = s.tokenizer.encode("<|im_start|>", true, false).unwrap();
    assert_eq!(prompt[0], im_start[0]);
    // generation_config.json lists <|im_end|> and <|endoftext|>.
    for t in ["<|im_end|>", "<|endoftext|>"] {
        let id = s.tokenizer.encode(t, true, false).unwrap()[0];
        assert!(s.tokenizer.is_end_of_generation(id), "{t}");
    }
}

#[test]
fn tensors_the_model_does_not_read_are_refused_by_name() {
    use safetensors::tensor::TensorView;
    let dir = std::env::temp_dir().join(format!("axiom-extra-tensor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture("qwen2")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    // The fixture's checkpoint with one more F32 vector of `len` named `extra`.
    let original = std::fs::read(fixture("qwen2").join("model.safetensors")).unwrap();
    let with_extra = |extra: &str, len: usize| {
        let checkpoint = safetensors::SafeTensors::deserialize(&original).unwrap();
        let values = vec![0x3du8; len * 4];
        let mut tensors = checkpoint.tensors();
        tensors.push((
            extra.to_string(),
            TensorView::new(safetensors::Dtype::F32, vec![len], &values).unwrap(),
        ));
        safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    };
    let options = LoadOptions {
        max_batch: 8,
        kv_tokens: 8,
        max_seqs: 1,
    };
    // Qwen2 has Q, K and V biases but none on the output projection.
    let name = "model.layers.1.self_attn.o_proj.bias";
    with_extra(name, 64);
    let err = Session::load(&dir, CpuBackend::new(1), options)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&format!("does not use: {name}")), "{err}");
    let out = dir.join("converted.gguf");
    let err = axiom::convert::convert_hf_dir(&dir, &out, axiom::format::quant::GgmlType::F32, |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("does not use: {name}")), "{err}");
    assert!(!out.exists());
    // The rotary frequencies some checkpoints carry are computed from the config instead.
    with_extra("model.layers.0.self_attn.rotary_emb.inv_freq", 8);
    let err = worst_error(&dir, &fixture("qwen2"), CpuBackend::reference(1));
    assert!(err < 1e-4, "relative L2 error {err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_expert_too_many_or_too_few_is_refused_by_name() {
    use safetensors::tensor::TensorView;
    let dir = std::env::temp_dir().join(format!("axiom-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture("qwen3_moe")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let original = std::fs::read(fixture("qwen3_moe").join("model.safetensors")).unwrap();
    let options = LoadOptions {
        max_batch: 8,
        kv_tokens: 8,
        max_seqs: 1,
    };
    // The checkpoint without the tensors `drop` names, with one more F32 `[48, 64]` if `extra`.
    let values = vec![0u8; 48 * 64 * 4];
    let load_error = |extra: Option<&str>, drop: &dyn Fn(&str) -> bool| {
        let checkpoint = safetensors::SafeTensors::deserialize(&original).unwrap();
        let mut tensors: Vec<(String, TensorView)> =
            checkpoint.tensors().into_iter().filter(|(n, _)| !drop(n)).collect();
        if let Some(name) = extra {
            let view = TensorView::new(safetensors::Dtype::F32, vec![48, 64], &values).unwrap();
            tensors.push((name.to_string(), view));
        }
        safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
        Session::load(&dir, CpuBackend::new(1), options)
            .err()
            .unwrap()
            .to_string()
    };
    // A seventh expert of six.
    let extra = "model.layers.0.mlp.experts.6.up_proj.weight";
    let err = load_error(Some(extra), &|_| false);
    assert!(err.contains(&format!("does not use: {extra}")), "{err}");
    // An expert's matrix missing, or every expert's.
    let err = load_error(None, &|n| n == "model.layers.2.mlp.experts.3.down_proj.weight");
    assert!(err.contains("missing tensor blk.2.ffn_down_exps.3.weight"), "{err}");
    let err = load_error(None, &|n| n.contains("layers.0.mlp.experts."));
    assert!(err.contains("missing tensor blk.0.ffn_gate_exps.weight"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
