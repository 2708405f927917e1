//! A model opened before it loads: the configuration and weight size that callers size the KV
//! cache and check memory with.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use axiom::model::{ModelConfig, ModelFiles};
use std::path::{Path, PathBuf};

fn file_len(path: &Path) -> usize {
    std::fs::metadata(path).unwrap().len() as usize
}

#[test]
fn a_directory_weighs_its_safetensors_shards() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let files = ModelFiles::open(&dir).unwrap();
    let shards: usize = (1..=4)
        .map(|i| file_len(&dir.join(format!("model-0000{i}-of-00004.safetensors"))))
        .sum();
    // Not the directory entry's length, nor its tokenizer and reference logits.
    assert_eq!(files.weight_bytes(), shards);
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(files.config, ModelConfig::from_hf(&json).unwrap());
}

#[test]
fn a_gguf_file_weighs_its_length() {
    let path = axiom::source::default_model().expect("the default model can be fetched");
    let files = ModelFiles::open(&path).unwrap();
    assert_eq!(files.weight_bytes(), file_len(&path));
    assert_eq!(files.config.architecture, "llama");
}
