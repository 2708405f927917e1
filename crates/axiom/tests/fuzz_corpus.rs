//! Replays the fuzz seeds and every crash the fuzzers ever found (`fuzz/seeds/<target>/`,
//! `fuzz/regressions/<target>/`) through the targets' entry points.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use std::path::PathBuf;

fn replay(target: &str, run: fn(&[u8])) -> usize {
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut n = 0;
    for dir in [fuzz.join("seeds").join(target), fuzz.join("regressions").join(target)] {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.file_name().is_some_and(|n| n != ".keep") {
                run(&std::fs::read(&path).unwrap());
                n += 1;
            }
        }
    }
    n
}

#[test]
fn every_corpus_input_is_handled() {
    assert!(replay("gguf", axiom::untrusted::gguf) > 1);
    assert!(replay("safetensors", axiom::untrusted::safetensors) > 1);
    assert!(replay("chat_template", axiom::untrusted::chat_template) > 1);
}

#[test]
fn every_tokenizer_input_round_trips() {
    let file = axiom::format::gguf::GgufFile::open(&axiom::source::default_model().unwrap()).unwrap();
    let tokenizer = axiom::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    TOKENIZER.with(|t| *t.borrow_mut() = Some(tokenizer));
    assert!(
        replay("tokenizer", |data| TOKENIZER.with(|t| {
            axiom::untrusted::tokenizer_round_trip(t.borrow().as_ref().unwrap(), data)
        })) > 1
    );
}

thread_local! {
    static TOKENIZER: std::cell::RefCell<Option<axiom::tokenizer::Tokenizer>> = const { std::cell::RefCell::new(None) };
}
