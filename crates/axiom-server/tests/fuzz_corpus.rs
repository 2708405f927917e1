//! Replays the request fuzz target's seeds and regressions (`fuzz/seeds/request/`,
//! `fuzz/regressions/request/`) through its entry point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use std::path::PathBuf;

#[test]
fn every_request_corpus_input_is_handled() {
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut n = 0;
    for dir in [fuzz.join("seeds/request"), fuzz.join("regressions/request")] {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.file_name().is_some_and(|n| n != ".keep") {
                axiom_server::api::untrusted_request(&std::fs::read(&path).unwrap());
                n += 1;
            }
        }
    }
    assert!(n > 1);
}
