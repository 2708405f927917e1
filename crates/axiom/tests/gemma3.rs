//! Gemma 3 270M (its Q4_K_M GGUF, from PyPI) end to end against llama.cpp on the same file
//! (`refs/gemma3/`): tokenization, perplexity, greedy continuations.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::format::gguf::GgufFile;
use axiom::tokenizer::Tokenizer;

fn gemma_refs(file: &str) -> serde_json::Value {
    let path = common::refs("../gemma3").join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn tokenizes_like_llama_cpp() {
    let tok = Tokenizer::from_gguf(&GgufFile::open(&common::gemma3_270m()).unwrap()).unwrap();
    let refs = gemma_refs("tokenization.json");
    for case in refs["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        for (mode, special, bos) in [
            ("parse_special", true, true),
            ("no_parse_special", false, true),
            ("parse_special_no_bos", true, false),
            ("no_parse_special_no_bos", false, false),
        ] {
            let want: Vec<u32> = case[mode]["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text, special, bos).unwrap();
            assert_eq!(got, want, "{} ({mode}): {text:?}", case["name"]);
        }
    }
}
