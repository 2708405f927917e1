//! Fuzz target: see `axiom::untrusted::safetensors`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| axiom::untrusted::safetensors(data));
