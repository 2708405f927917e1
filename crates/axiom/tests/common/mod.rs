//! Helpers shared by the integration tests.
#![allow(dead_code)]

use axiom::backend::Backend;
use axiom::engine::Session;
use axiom::format::quant::GgmlType;
use axiom::model::llama::LoadOptions;
use axiom::model::LogitRows;
use half::f16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

/// The engine crate's `tests` directory (this module is shared with the CLI crate's tests).
fn tests_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    match manifest.ends_with("axiom-cli") {
        true => manifest.join("../axiom/tests"),
        false => manifest.join("tests"),
    }
}

/// Reference outputs for SmolLM2 (copied from the project's shared refs).
pub fn refs(file: &str) -> PathBuf {
    tests_dir().join("refs/smollm2").join(file)
}

pub fn read_json(file: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(refs(file)).unwrap()).unwrap()
}

/// The default model, fetched into the cache by the engine's own mechanism if it is missing.
pub fn smollm2() -> PathBuf {
    axiom::source::default_model().expect("the default model can be fetched")
}

/// Writes GGUF images field by field, so tests can build valid files and precise corruptions.
pub struct GgufWriter {
    pub buf: Vec<u8>,
}

impl GgufWriter {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> GgufWriter {
        let mut w = GgufWriter { buf: b"GGUF".to_vec() };
        w.u32(version).u64(n_tensors).u64(n_kv);
        w
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
        self
    }
    /// A u32 metadata pair.
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.string(key).u32(4).u32(v)
    }
    pub fn kv_string(&mut self, key: &str, v: &str) -> &mut Self {
        self.string(key).u32(8).string(v)
    }
    pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.string(key).u32(7);
        self.buf.push(v as u8);
        self
    }
    pub fn kv_strings(&mut self, key: &str, items: &[&str]) -> &mut Self {
        self.string(key).u32(9).u32(8).u64(items.len() as u64);
        for s in items {
            self.string(s);
        }
        self
    }
    pub fn kv_f32s(&mut self, key: &str, items: &[f32]) -> &mut Self {
        self.string(key).u32(9).u32(6).u64(items.len() as u64);
        for v in items {
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
        self
    }
    pub fn kv_i32s(&mut self, key: &str, items: &[i32]) -> &mut Self {
        self.string(key).u32(9).u32(5).u64(items.len() as u64);
        for v in items {
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
        self
    }
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.string(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to the default 32-byte alignment where the data section starts.
    pub fn align(&mut self) -> &mut Self {
        while !self.buf.len().is_multiple_of(32) {
            self.buf.push(0);
        }
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
}

/// A valid two-tensor file: metadata, an F32 [8] and a Q8_0 [32, 2] tensor.
pub fn valid_gguf() -> Vec<u8> {
    let mut w = GgufWriter::header(3, 2, 2);
    w.kv_string("general.architecture", "llama")
        .kv_u32("general.alignment", 32);
    w.tensor_info("a", &[8], 0, 0).tensor_info("b", &[32, 2], 8, 64);
    w.align();
    let mut data = vec![0u8; 64 + 68];
    data[..32].copy_from_slice(&[0, 0, 128, 63].repeat(8)); // eight 1.0f32
    w.bytes(&data);
    w.buf
}

/// Random blocks of `ty` with finite f16 scales (at the byte offsets of each layout).
pub fn random_weight_bytes(rng: &mut ChaCha8Rng, ty: GgmlType, n_elements: usize) -> Vec<u8> {
    let n_blocks = n_elements / ty.block_len();
    let mut bytes: Vec<u8> = (0..n_blocks * ty.block_bytes()).map(|_| rng.random()).collect();
    let f16_fields: &[usize] = match ty {
        GgmlType::F32 => {
            return (0..n_elements)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
        }
        GgmlType::F16 | GgmlType::BF16 => &[0],
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
    };
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &off in f16_fields {
            let v = rng.random_range(-0.1f32..0.1);
            let bits = match ty {
                GgmlType::BF16 => half::bf16::from_f32(v).to_bits(),
                _ => f16::from_f32(v).to_bits(),
            };
            block[off..off + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    bytes
}

/// A tiny Hugging Face model of `scripts/make_hf_fixtures.py`.
pub fn hf_fixture(name: &str) -> PathBuf {
    tests_dir().join("fixtures/hf").join(name)
}

/// The relative L2 error of our logits for every position of every reference sequence.
/// `model` (a directory or a GGUF file) is loaded on `backend`; `reference` is the fixture
/// directory holding transformers' logits.
pub fn worst_error<B: Backend>(model: &Path, reference: &Path, backend: B) -> f64 {
    let dir = reference;
    let name = reference.file_name().unwrap().to_string_lossy();
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap()).unwrap();
    let want: Vec<f32> = std::fs::read(dir.join("logits.bin"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let mut s = Session::load(
        model,
        backend,
        LoadOptions {
            max_batch: 64,
            kv_tokens: 64,
        },
    )
    .unwrap();
    let vocab = refs["vocab"].as_u64().unwrap() as usize;
    let mut offset = 0;
    let mut worst = 0f64;
    for (text, ids) in refs["texts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(refs["ids"].as_array().unwrap())
    {
        let ids: Vec<u32> = ids
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        // Our tokenizer gives transformers' ids (special tokens parsed, none added).
        assert_eq!(
            s.tokenizer.encode(text.as_str().unwrap(), true, false).unwrap(),
            ids,
            "{name}: {text}"
        );
        let mut kv = s.model.new_kv_cache(64).unwrap();
        let mut got = Vec::new();
        s.model
            .forward(&ids, &mut kv, LogitRows::From(0), |_, l| got.extend_from_slice(l))
            .unwrap();
        s.model.free_kv_cache(kv).unwrap();
        let reference = &want[offset..offset + ids.len() * vocab];
        offset += ids.len() * vocab;
        let err: f64 = got.iter().zip(reference).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
        let norm: f64 = reference.iter().map(|w| (*w as f64).powi(2)).sum();
        worst = worst.max((err / norm).sqrt());
    }
    assert_eq!(offset, want.len(), "{name}: every reference logit compared");
    worst
}
