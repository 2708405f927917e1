//! The GGUF reader and the reference dequantizers, against fixtures written by the `gguf` PyPI
//! package (scripts/make_quant_fixtures.py), plus the bad-input matrix.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::format::gguf::{GgufError, GgufFile, Value};
use axiom::format::quant::{dequantize, GgmlType};
use common::{valid_gguf, GgufWriter};
use std::path::PathBuf;

fn fixture() -> GgufFile {
    GgufFile::open(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quants.gguf")).unwrap()
}

#[test]
fn every_metadata_value_type_reads_back() {
    let f = fixture();
    assert_eq!(f.version, 3);
    let get = |k: &str| f.get(k).unwrap_or_else(|| panic!("missing {k}")).clone();
    assert_eq!(get("test.u8"), Value::U8(200));
    assert_eq!(get("test.i8"), Value::I8(-100));
    assert_eq!(get("test.u16"), Value::U16(60000));
    assert_eq!(get("test.i16"), Value::I16(-30000));
    assert_eq!(get("test.u32"), Value::U32(4_000_000_000));
    assert_eq!(get("test.i32"), Value::I32(-2_000_000_000));
    assert_eq!(get("test.u64"), Value::U64((1 << 63) + 5));
    assert_eq!(get("test.i64"), Value::I64(-(1 << 62)));
    assert_eq!(get("test.f32"), Value::F32(1.5));
    assert_eq!(get("test.f64"), Value::F64(-2.25));
    assert_eq!(get("test.bool"), Value::Bool(true));
    assert_eq!(get("test.string"), Value::String("héllo ✓".into()));
    assert_eq!(
        get("test.array_i32"),
        Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])
    );
    assert_eq!(
        get("test.array_str"),
        Value::Array(vec![
            Value::String("a".into()),
            Value::String("bc".into()),
            Value::String("".into())
        ])
    );
    let nested = get("test.nested");
    let outer = nested.as_array().unwrap();
    assert_eq!(outer.len(), 2);
    assert_eq!(outer[0].as_array().unwrap().len(), 2);
    assert_eq!(outer[1].as_array().unwrap()[0].as_i64(), Some(3));
}

#[test]
fn every_tensor_type_dequantizes_like_gguf_py() {
    let f = fixture();
    for ty in GgmlType::ALL {
        let raw = f
            .tensor(&format!("{}.raw", ty.name()))
            .unwrap_or_else(|| panic!("no fixture for {ty}"));
        let expected = f.tensor(&format!("{}.expected", ty.name())).unwrap();
        assert_eq!(raw.ty, ty);
        assert_eq!(raw.dims, expected.dims, "{ty}");
        let want: Vec<f32> = f
            .tensor_bytes(expected)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut got = vec![f32::NAN; raw.n_elements()];
        dequantize(ty, f.tensor_bytes(raw), &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{ty} element {i}: got {g}, want {w}"
            );
        }
    }
}

#[test]
fn valid_minimal_file_parses() {
    let f = GgufFile::from_bytes(&valid_gguf()).unwrap();
    assert_eq!(f.tensors.len(), 2);
    let a = f.tensor("a").unwrap();
    assert_eq!(f.tensor_bytes(a).len(), 32);
    assert_eq!(f.tensor("b").unwrap().size_bytes, 68);
}

fn parse(bytes: &[u8]) -> GgufError {
    match GgufFile::from_bytes(bytes) {
        Ok(_) => panic!("corrupt file accepted"),
        Err(e) => {
            // Every error renders to a message that names the problem.
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

#[test]
fn bad_input_matrix() {
    let valid = valid_gguf();

    let mut bad = valid.clone();
    bad[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse(&bad), GgufError::BadMagic(_)));

    let mut bad = valid.clone();
    bad[4] = 1;
    assert!(matches!(parse(&bad), GgufError::UnsupportedVersion(1)));

    // Truncated anywhere in the header.
    for cut in [2, 6, 12, 20, 30, 60, 100] {
        let e = parse(&valid[..cut]);
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::ImpossibleCount { .. }),
            "cut {cut}: {e}"
        );
    }

    // Truncated tensor data: the last tensor no longer fits.
    let e = parse(&valid[..valid.len() - 1]);
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { ref name, .. } if name == "b"),
        "{e}"
    );

    // Absurd counts are refused before anything is allocated for them.
    let e = parse(&GgufWriter::header(3, u64::MAX, 0).buf);
    assert!(matches!(e, GgufError::ImpossibleCount { .. }), "{e}");
    let e = parse(&GgufWriter::header(3, 0, 1 << 60).buf);
    assert!(matches!(e, GgufError::ImpossibleCount { .. }), "{e}");
    let mut w = GgufWriter::header(3, 0, 1);
    w.string("k").u32(9).u32(4).u64(u64::MAX / 2);
    assert!(matches!(parse(&w.buf), GgufError::ImpossibleCount { .. }));

    // A string length far past the end.
    let mut w = GgufWriter::header(3, 0, 1);
    w.u64(u64::MAX).bytes(b"key").bytes(&[0; 16]);
    assert!(matches!(parse(&w.buf), GgufError::Truncated { .. }));

    // Unknown metadata value type; arrays nested too deep.
    let mut w = GgufWriter::header(3, 0, 1);
    w.string("k").u32(99);
    assert!(matches!(parse(&w.buf), GgufError::UnknownValueType { type_id: 99, .. }));
    let mut w = GgufWriter::header(3, 0, 1);
    w.string("k").u32(9);
    for _ in 0..10 {
        w.u32(9).u64(1);
    }
    assert!(matches!(parse(&w.buf), GgufError::ArrayTooDeep(_)));

    // Dimensions whose product overflows, zero dimensions, too many dimensions.
    for dims in [vec![u64::MAX, 2], vec![1 << 32, 1 << 32], vec![0, 4]] {
        let mut w = GgufWriter::header(3, 1, 0);
        w.tensor_info("t", &dims, 0, 0).align().bytes(&[0; 64]);
        assert!(matches!(parse(&w.buf), GgufError::BadDims { .. }), "{dims:?}");
    }
    let mut w = GgufWriter::header(3, 1, 0);
    w.tensor_info("t", &[1, 1, 1, 1, 1], 0, 0).align();
    assert!(matches!(parse(&w.buf), GgufError::TooManyDims { n_dims: 5, .. }));

    // Offsets past the end, offsets that wrap, misaligned and overlapping tensors.
    for offset in [1 << 20, u64::MAX - 7] {
        let mut w = GgufWriter::header(3, 1, 0);
        w.tensor_info("t", &[8], 0, offset).align().bytes(&[0; 32]);
        assert!(matches!(
            parse(&w.buf),
            GgufError::TensorOutOfBounds { .. } | GgufError::MisalignedOffset { .. }
        ));
    }
    let mut w = GgufWriter::header(3, 1, 0);
    w.tensor_info("t", &[8], 0, 4).align().bytes(&[0; 64]);
    assert!(matches!(parse(&w.buf), GgufError::MisalignedOffset { .. }));
    let mut w = GgufWriter::header(3, 2, 0);
    w.tensor_info("x", &[16], 0, 0)
        .tensor_info("y", &[16], 0, 32)
        .align()
        .bytes(&[0; 128]);
    assert!(matches!(parse(&w.buf), GgufError::OverlappingTensors { .. }));

    // Unknown and unsupported tensor types are named.
    for (ty, name) in [(77u32, "unknown (type id 77)"), (16, "IQ2_XXS")] {
        let mut w = GgufWriter::header(3, 1, 0);
        w.tensor_info("weird", &[256], ty, 0).align().bytes(&[0; 1024]);
        match parse(&w.buf) {
            GgufError::UnsupportedType {
                name: tensor,
                type_name,
            } => {
                assert_eq!(tensor, "weird");
                assert!(type_name.starts_with(name), "{type_name}");
            }
            e => panic!("{e}"),
        }
    }

    // A row that is not a whole number of blocks.
    let mut w = GgufWriter::header(3, 1, 0);
    w.tensor_info("q", &[20, 2], 8, 0).align().bytes(&[0; 128]);
    assert!(matches!(parse(&w.buf), GgufError::PartialBlock { .. }));

    // Bad alignment, duplicate keys and tensors, invalid UTF-8.
    let mut w = GgufWriter::header(3, 0, 1);
    w.kv_u32("general.alignment", 24);
    assert!(matches!(parse(&w.buf), GgufError::BadAlignment(24)));
    let mut w = GgufWriter::header(3, 0, 2);
    w.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(parse(&w.buf), GgufError::Duplicate { .. }));
    let mut w = GgufWriter::header(3, 2, 0);
    w.tensor_info("t", &[8], 0, 0)
        .tensor_info("t", &[8], 0, 32)
        .align()
        .bytes(&[0; 64]);
    assert!(matches!(parse(&w.buf), GgufError::Duplicate { .. }));
    let mut w = GgufWriter::header(3, 0, 1);
    w.u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(0);
    assert!(matches!(parse(&w.buf), GgufError::InvalidUtf8 { .. }));
}

#[test]
fn parsed_metadata_memory_is_bounded() {
    let u8_array = |n: usize| {
        let mut w = GgufWriter::header(3, 0, 1);
        w.string("bomb").u32(9).u32(0).u64(n as u64).bytes(&vec![7; n]);
        w.buf
    };
    // 3 MiB of file would be 96 MiB of 32-byte values: refused, naming the key and the limit.
    let e = parse(&u8_array(3 << 20));
    assert!(
        matches!(e, GgufError::MetadataTooLarge { ref key } if key == "bomb"),
        "{e}"
    );
    assert!(e.to_string().contains("64 MiB"), "{e}");
    // A third of that is a large vocabulary's size, and reads.
    let f = GgufFile::from_bytes(&u8_array(1 << 20)).unwrap();
    assert_eq!(
        f.get("bomb").and_then(Value::as_array).map(<[Value]>::len),
        Some(1 << 20)
    );

    // Small pairs cost about 100 bytes each once parsed, for 23 in the file: counted too.
    let n_kv = 1 << 20;
    let mut w = GgufWriter::header(3, 0, n_kv);
    for i in 0..n_kv {
        w.kv_u32(&format!("{i:07}"), 0);
    }
    assert!(matches!(parse(&w.buf), GgufError::MetadataTooLarge { .. }));
}

#[test]
fn every_prefix_of_a_valid_file_fails_cleanly() {
    let valid = valid_gguf();
    for cut in 0..valid.len() {
        assert!(
            GgufFile::from_bytes(&valid[..cut]).is_err(),
            "prefix of {cut} bytes accepted"
        );
    }
}

#[test]
fn missing_file_is_an_io_error() {
    let e = GgufFile::open(std::path::Path::new("/nonexistent/model.gguf"))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/model.gguf"));
}

/// The config of a GGUF file holding only a small `arch` model's metadata, `extra` keys and
/// `tensors` (F32 vectors).
fn config_of(
    arch: &str,
    extra: &[(&str, Value)],
    tensors: &[(&str, &[f32])],
) -> axiom::Result<axiom::model::ModelConfig> {
    let mut w = axiom::format::gguf_writer::GgufWriter::default();
    w.set("general.architecture", Value::String(arch.into()));
    for (key, value) in [
        ("block_count", 2u32),
        ("context_length", 256),
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("attention.head_count", 4),
        ("vocab_size", 1000),
    ] {
        w.set(&format!("{arch}.{key}"), Value::U32(value));
    }
    for (key, value) in extra {
        w.set(&format!("{arch}.{key}"), value.clone());
    }
    for (name, values) in tensors {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.tensor(name, GgmlType::F32, &[values.len()], bytes).unwrap();
    }
    let path = std::env::temp_dir().join(format!("axiom-rope-{}-{arch}.gguf", std::process::id()));
    w.write(&path).unwrap();
    let config = axiom::model::ModelConfig::from_gguf(&GgufFile::open(&path).unwrap());
    std::fs::remove_file(path).unwrap();
    config
}

#[test]
fn rope_scaling_keys_read_as_llama_cpp_writes_them() {
    use axiom::backend::{RopeScaling, Yarn};
    let yarn = [
        ("rope.scaling.type", Value::String("yarn".into())),
        ("rope.scaling.factor", Value::F32(4.0)),
        ("rope.scaling.original_context_length", Value::U32(64)),
    ];
    let c = config_of("qwen2", &yarn, &[]).unwrap();
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Yarn(Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true
        })
    ));
    // llama.cpp's attention factor is YaRN's own `0.1 ln(s) + 1`, times `attn_factor` if given.
    assert!(
        (c.rope.scale - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6,
        "{}",
        c.rope.scale
    );
    let with = |extra: (&str, Value)| config_of("qwen2", &[yarn.clone().as_slice(), &[extra]].concat(), &[]);
    let c = with(("rope.scaling.attn_factor", Value::F32(0.5))).unwrap();
    assert!((c.rope.scale - 0.5 * (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6);
    let err = with(("rope.scaling.yarn_log_multiplier", Value::F32(0.1)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("yarn_log_multiplier"), "{err}");

    // Phi-3's LongRoPE: both factor lists as tensors, the long ones past the original context.
    let (short, long) = ([1.0f32, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5], [2.0f32; 8]);
    let phi3 = [("rope.scaling.original_context_length", Value::U32(32))];
    let c = config_of(
        "phi3",
        &phi3,
        &[
            ("rope_factors_short.weight", &short),
            ("rope_factors_long.weight", &long),
        ],
    )
    .unwrap();
    assert!(matches!(c.rope.scaling, RopeScaling::LongRope { original_context: 32 }));
    // Without `attn_factor`, transformers' `sqrt(1 + ln(256 / 32) / ln(32))`.
    assert!((c.rope.scale - (1.0 + 8f32.ln() / 32f32.ln()).sqrt()).abs() < 1e-6);
    let base = c.rope.inverse_frequencies();
    for (longest, factors) in [(32, &short), (33, &long)] {
        let freqs = c.rope_frequencies(longest);
        assert!(freqs
            .iter()
            .zip(&base)
            .zip(factors)
            .all(|((f, b), d)| (f * d - b).abs() <= 1e-6 * b));
    }
    let err = config_of("phi3", &phi3, &[("rope_factors_short.weight", &short)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope_factors_long"), "{err}");
}

#[test]
fn sliding_windows_are_read_as_llama_cpp_writes_them() {
    // Phi-3's window (llama.cpp writes Phi-3-mini-4k's) covers every layer.
    let c = config_of("phi3", &[("attention.sliding_window", Value::U32(200))], &[]).unwrap();
    let s = c.sliding.unwrap();
    assert_eq!((s.window, s.layers, s.rope), (200, vec![true, true], None));
    // Gemma 3's local layers are five of six, with a rope base of their own.
    let c = config_of("gemma3", &[("attention.sliding_window", Value::U32(16))], &[]).unwrap();
    let s = c.sliding.unwrap();
    assert_eq!(s.layers, vec![true, true]);
    assert_eq!(s.rope.map(|r| r.theta), Some(10000.0));
    // An explicit pattern must give one boolean a layer.
    let pattern = |flags: &[bool]| Value::Array(flags.iter().map(|&b| Value::Bool(b)).collect());
    let c = config_of(
        "qwen2",
        &[
            ("attention.sliding_window", Value::U32(16)),
            ("attention.sliding_window_pattern", pattern(&[false, true])),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(c.sliding.unwrap().layers, vec![false, true]);
    let err = config_of(
        "qwen2",
        &[
            ("attention.sliding_window", Value::U32(16)),
            ("attention.sliding_window_pattern", pattern(&[true])),
        ],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("one boolean per layer"), "{err}");
}
