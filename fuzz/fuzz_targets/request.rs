//! Fuzz target: see `axiom_server::api::untrusted_request`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| axiom_server::api::untrusted_request(data));
