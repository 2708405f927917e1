//! Fuzz target: see `axiom::untrusted::tokenizer_round_trip`, with the default model's
//! vocabulary (fetched into the cache on the first run).
#![no_main]
use std::sync::OnceLock;

static TOKENIZER: OnceLock<axiom::tokenizer::Tokenizer> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let tokenizer = TOKENIZER.get_or_init(|| {
        let path = axiom::source::default_model().expect("the default model");
        let file = axiom::format::gguf::GgufFile::open(&path).expect("a readable model");
        axiom::tokenizer::Tokenizer::from_gguf(&file).expect("its tokenizer")
    });
    axiom::untrusted::tokenizer_round_trip(tokenizer, data);
});
