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
    for &name in common::HF_FIXTURES {
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
        // them the weights' rounding error.
        let tolerance = if name == "phi3" { 0.08 } else { 0.05 };
        assert!(err < tolerance, "{name} Q8_0 GGUF: relative L2 error {err}");
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
