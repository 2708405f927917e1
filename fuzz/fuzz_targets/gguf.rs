//! Fuzz target: see `axiom::untrusted::gguf`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| axiom::untrusted::gguf(data));
