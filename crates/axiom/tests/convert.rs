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
use axiom::format::quant::GgmlType;
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
        assert!(err < 0.05, "{name} Q8_0 GGUF: relative L2 error {err}");
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
