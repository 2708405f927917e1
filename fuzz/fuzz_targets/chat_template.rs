//! Fuzz target: see `axiom::untrusted::chat_template`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| axiom::untrusted::chat_template(data));
