//! The safetensors reader's bad-input matrix: every corruption is a clear error, never a panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use axiom::format::safetensors::SafetensorsModel;

/// A safetensors image: the header JSON (padded to 8 bytes) and the data.
fn image(header: &str, data_len: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend(std::iter::repeat_n(0u8, data_len));
    out
}

fn error(bytes: &[u8]) -> String {
    match SafetensorsModel::from_bytes(bytes) {
        Ok(_) => panic!("corrupt file accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_valid_file_reads() {
    let m = SafetensorsModel::from_bytes(&image(
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#,
        24,
    ))
    .unwrap();
    let w = m.get("w").unwrap();
    assert_eq!(w.dims, vec![3, 2], "GGML order: the row length first");
    assert_eq!(m.bytes(w).len(), 24);
}

#[test]
fn bad_input_matrix() {
    let ok = r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#;
    // Truncated before the header length; header length past the end; header cut short.
    assert!(error(&[1, 2, 3]).contains("truncated"));
    let mut past = image(ok, 24);
    past[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(error(&past).contains("past the end"), "{}", error(&past));
    let full = image(ok, 24);
    let e = error(&full[..20]);
    assert!(e.contains("past the end") || e.contains("invalid"), "{e}");
    // Not JSON.
    assert!(error(&image("{not json", 0)).contains("invalid safetensors"));
    // Data shorter than the offsets say (truncated tensor data).
    assert!(!error(&image(ok, 16)).is_empty());
    // Offsets out of bounds, overlapping, or not matching the dtype and shape.
    for header in [
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,1000]}}"#,
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        r#"{"w":{"dtype":"F32","shape":[5,3],"data_offsets":[0,24]}}"#,
        r#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,24]}}"#,
    ] {
        let e = error(&image(header, 24));
        assert!(!e.is_empty(), "{header}");
    }
    // A dtype the engine does not run is named.
    let e = error(&image(r#"{"w":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}}"#, 24));
    assert!(e.contains("I64") && e.contains('w'), "{e}");
}

#[test]
fn sharded_checkpoints_are_read_through_their_index() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let m = SafetensorsModel::open_dir(&dir, None).unwrap();
    // Tensors from the first and the last shard.
    assert!(m.get("model.embed_tokens.weight").is_some());
    assert!(m.get("model.norm.weight").is_some());
    assert_eq!(m.names().count(), 2 + 1 + 2 * 9);
}
