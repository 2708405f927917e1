//! Every Metal kernel, run on the CPU through the MSL shim, against axiom's CPU reference on
//! random inputs at awkward sizes: head_dim 48, 35 positions, 9 heads over 3 KV heads, rows that
//! are not a multiple of the threadgroup, threadgroups of 1 to 4 simdgroups. Outputs start as
//! NaN, so an element a kernel never writes fails; masked scores must be exactly -inf. Attention
//! runs causal and under every score rule of the engine's tests (windows, a soft cap, a scale),
//! one test per rule and cache type; the prompt attention over contexts of 1, 7, 64 and 200. The
//! mixture-of-experts kernels at 6 experts, top-2, router logits with exact ties, 1/7/33 tokens.
//! Weights in every type the Metal backend runs (`GPU_WEIGHT_TYPES`), FP8 blocks among them,
//! and every E4M3 code decoded bit for bit.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

#[path = "../../axiom/tests/common/mod.rs"]
mod common;

use axiom::backend::cpu::kernels::experts::{Expert, ExpertMatrix};
use axiom::backend::cpu::kernels::{self as reference, paged::PageMap};
use axiom::backend::{Activation, AttentionShape, Rope, RopeLayout, RopeScaling, Routing, Scores};
use axiom::format::fp8::{self, E4M3_VALUES};
use axiom::format::quant::GgmlType;
use common::gpu::{randn, rel_l2, weight_types};
use common::{capped_window, paged_queries, random_weight_bytes, score_rules, PagedCase, PAGED_LENS};
use half::f16;
use metal_on_cpu::{Cache, ExpertStack, Experts, Heads, Pages, Rule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

/// A row length that is not a multiple of the 32 lanes in blocks (or elements, for floats).
fn awkward_n_in(ty: GgmlType) -> usize {
    match ty.block_len() {
        1 => 35,
        32 => 32 * 5,
        _ => 256 * 3,
    }
}

#[test]
fn matmul_every_type_matches_the_reference() {
    let mut rng = rng();
    for ty in weight_types() {
        let (n_in, n_out, n_tokens) = (awkward_n_in(ty), 37, 3);
        let w = random_weight_bytes(&mut rng, ty, n_in * n_out);
        let x = randn(&mut rng, n_tokens * n_in);
        let mut want = vec![0f32; n_tokens * n_out];
        reference::matmul::matmul_rows(ty, &w, n_in, 0..n_out, &x, &mut want);
        for simds in [1, 4] {
            let mut got = vec![f32::NAN; n_tokens * n_out];
            metal_on_cpu::matmul(
                ty.id(),
                &w,
                ty.row_bytes(n_in),
                &x,
                None,
                &mut got,
                n_in,
                n_tokens,
                false,
                simds,
            );
            let err = rel_l2(&got, &want);
            assert!(err < 1e-5, "{ty} with {simds} simdgroups: relative error {err}");
        }
        let (residual, want_sum) = residual_and_sum(&mut rng, &want);
        let mut got = residual;
        metal_on_cpu::matmul(
            ty.id(),
            &w,
            ty.row_bytes(n_in),
            &x,
            None,
            &mut got,
            n_in,
            n_tokens,
            true,
            4,
        );
        let err = rel_l2(&got, &want_sum);
        assert!(err < 1e-5, "{ty} added to a residual: relative error {err}");
    }
}

/// The row matmul with the RMS norm taken on the way in, against the reference's norm, then
/// matmul; rows of an odd length for the float types, so that lanes hold different counts.
#[test]
fn matmul_normalizing_its_input_matches_rms_norm_then_matmul() {
    let mut rng = rng();
    for ty in weight_types() {
        let (n_in, n_out, n_tokens) = (awkward_n_in(ty), 37, 3);
        let w = random_weight_bytes(&mut rng, ty, n_in * n_out);
        let (x, g) = (randn(&mut rng, n_tokens * n_in), randn(&mut rng, n_in));
        let want = normed_product(ty, &w, &x, &g, n_in, n_out);
        let mut got = vec![f32::NAN; n_tokens * n_out];
        let norm = metal_on_cpu::Norm { weight: &g, eps: 1e-5 };
        metal_on_cpu::matmul(
            ty.id(),
            &w,
            ty.row_bytes(n_in),
            &x,
            Some(norm),
            &mut got,
            n_in,
            n_tokens,
            false,
            3,
        );
        let err = rel_l2(&got, &want);
        assert!(err < 1e-5, "{ty}: relative error {err}");
    }
}

/// The reference's `x` under the RMS norm of `g`, times `w` (`n_out` rows of `n_in`).
fn normed_product(ty: GgmlType, w: &[u8], x: &[f32], g: &[f32], n_in: usize, n_out: usize) -> Vec<f32> {
    let mut normed = vec![0f32; x.len()];
    reference::rms_norm::rms_norm(x, g, &mut normed, n_in, 1e-5);
    let mut out = vec![0f32; x.len() / n_in * n_out];
    reference::matmul::matmul_rows(ty, w, n_in, 0..n_out, &normed, &mut out);
    out
}

/// The gate and up products and the gated activation in one kernel, on rows as they are (SiLU)
/// and normalized on the way in (GELU), against the reference's matmuls and glu.
#[test]
fn matmul_glu_every_type_matches_the_reference() {
    let mut rng = rng();
    for ty in weight_types() {
        let (n_in, n_out, n_tokens) = (awkward_n_in(ty), 37, 3);
        let w_gate = random_weight_bytes(&mut rng, ty, n_in * n_out);
        let w_up = random_weight_bytes(&mut rng, ty, n_in * n_out);
        let (x, g) = (randn(&mut rng, n_tokens * n_in), randn(&mut rng, n_in));
        for (act, normed) in [(Activation::Silu, false), (Activation::GeluTanh, true)] {
            let (gate, up) = if normed {
                (
                    normed_product(ty, &w_gate, &x, &g, n_in, n_out),
                    normed_product(ty, &w_up, &x, &g, n_in, n_out),
                )
            } else {
                let (mut gate, mut up) = (vec![0f32; n_tokens * n_out], vec![0f32; n_tokens * n_out]);
                reference::matmul::matmul_rows(ty, &w_gate, n_in, 0..n_out, &x, &mut gate);
                reference::matmul::matmul_rows(ty, &w_up, n_in, 0..n_out, &x, &mut up);
                (gate, up)
            };
            let mut want = vec![0f32; n_tokens * n_out];
            reference::glu::glu(&gate, &up, &mut want, act);
            let mut got = vec![f32::NAN; n_tokens * n_out];
            let norm = normed.then_some(metal_on_cpu::Norm { weight: &g, eps: 1e-5 });
            metal_on_cpu::matmul_glu(
                ty.id(),
                [&w_gate, &w_up],
                ty.row_bytes(n_in),
                &x,
                norm,
                &mut got,
                n_in,
                n_tokens,
                act.code(),
                2,
            );
            let err = rel_l2(&got, &want);
            assert!(err < 1e-5, "{ty}, {act:?}, normed {normed}: relative error {err}");
        }
    }
}

/// A random residual stream and what adding `product` to it gives.
fn residual_and_sum(rng: &mut ChaCha8Rng, product: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let residual = randn(rng, product.len());
    let sum = residual.iter().zip(product).map(|(r, p)| r + p).collect();
    (residual, sum)
}

/// Sizes the tiles (32 tokens by 64 rows by 32 inner values) do not divide: 35 rows; 1, 7 and 64
/// tokens; inner 48 and 200 for the float types, and for the block types a length that is a
/// whole number of their blocks.
fn tiled_cases(ty: GgmlType) -> Vec<(usize, usize, usize)> {
    let inner: &[usize] = match ty.block_len() {
        1 => &[48, 200],
        32 => &[32 * 5],
        _ => &[256 * 2],
    };
    let mut cases = Vec::new();
    for &n_in in inner {
        for n_tokens in [1, 7, 64] {
            cases.push((n_in, 35, n_tokens));
        }
    }
    cases.push((inner[0], 130, 33)); // three tiles of rows, two of tokens
    cases
}

#[test]
fn matmul_tiled_every_type_matches_the_reference() {
    let mut rng = rng();
    for ty in weight_types() {
        for (n_in, n_out, n_tokens) in tiled_cases(ty) {
            let w = random_weight_bytes(&mut rng, ty, n_in * n_out);
            let x = randn(&mut rng, n_tokens * n_in);
            let mut want = vec![0f32; n_tokens * n_out];
            reference::matmul::matmul_rows(ty, &w, n_in, 0..n_out, &x, &mut want);
            let mut got = vec![f32::NAN; n_tokens * n_out];
            metal_on_cpu::matmul_tiled(ty.id(), &w, ty.row_bytes(n_in), &x, &mut got, n_in, n_tokens, false);
            let err = rel_l2(&got, &want);
            assert!(
                err < 1e-5,
                "{ty}, {n_tokens} tokens x {n_out} rows x {n_in}: relative error {err}"
            );
            let (residual, want_sum) = residual_and_sum(&mut rng, &want);
            let mut got = residual;
            metal_on_cpu::matmul_tiled(ty.id(), &w, ty.row_bytes(n_in), &x, &mut got, n_in, n_tokens, true);
            let err = rel_l2(&got, &want_sum);
            assert!(
                err < 1e-5,
                "{ty}, {n_tokens} tokens x {n_out} rows x {n_in} added to a residual: relative error {err}"
            );
        }
    }
}

/// One partial tile with two slices of inner values: small enough for ThreadSanitizer to watch
/// the staging and the barriers around it (scripts/metal_planted_bugs.sh) in seconds.
#[test]
fn matmul_tiled_one_partial_tile_matches_the_reference() {
    let mut rng = rng();
    let (ty, n_in, n_out, n_tokens) = (GgmlType::Q4_0, 64, 35, 7);
    let w = random_weight_bytes(&mut rng, ty, n_in * n_out);
    let x = randn(&mut rng, n_tokens * n_in);
    let mut want = vec![0f32; n_tokens * n_out];
    reference::matmul::matmul_rows(ty, &w, n_in, 0..n_out, &x, &mut want);
    let mut got = vec![f32::NAN; n_tokens * n_out];
    metal_on_cpu::matmul_tiled(ty.id(), &w, ty.row_bytes(n_in), &x, &mut got, n_in, n_tokens, false);
    let err = rel_l2(&got, &want);
    assert!(err < 1e-5, "relative error {err}");
}

#[test]
fn embed_every_type_matches_the_reference() {
    let mut rng = rng();
    for ty in weight_types() {
        let (dim, vocab) = (awkward_n_in(ty), 11);
        let table = random_weight_bytes(&mut rng, ty, dim * vocab);
        let ids = [3u32, 0, 10, 3];
        let mut want = vec![0f32; ids.len() * dim];
        reference::embed::embed(ty, &table, dim, &ids, &mut want);
        let mut got = vec![f32::NAN; ids.len() * dim];
        metal_on_cpu::embed(ty.id(), &table, ty.row_bytes(dim), &ids, &mut got, dim, 48);
        assert_eq!(got, want, "{ty}: the same dequantization, value for value");
    }
}

/// Every E4M3 code (zeros of both signs, subnormals, 448, the two NaNs) through FP8 blocks of
/// scale 1, then -0.375: bit for bit the CPU's table times the scale (NaN for the NaN codes).
#[test]
fn fp8_every_e4m3_code_decodes_exactly() {
    let ty = GgmlType::Fp8;
    let codes: Vec<u8> = (0..=255).collect();
    let rows = codes.len() / fp8::CODES_PER_BLOCK;
    let ids: Vec<u32> = (0..rows as u32).collect();
    for scale in [1.0f32, -0.375] {
        let mut table = vec![0u8; rows * fp8::BLOCK_BYTES];
        fp8::pack(&codes, fp8::CODES_PER_BLOCK, |_, _| scale, &mut table);
        // E4M3 has no infinities: an infinity left is a value never written.
        let mut got = vec![f32::INFINITY; codes.len()];
        metal_on_cpu::embed(
            ty.id(),
            &table,
            ty.block_bytes(),
            &ids,
            &mut got,
            fp8::CODES_PER_BLOCK,
            8,
        );
        for (code, (got, value)) in got.iter().zip(E4M3_VALUES).enumerate() {
            let want = value * scale;
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "code {code:#04x}, scale {scale}: {got:e}, not {want:e}"
            );
        }
    }
}

#[test]
fn rms_norm_matches_the_reference() {
    let mut rng = rng();
    for (dim, threads) in [(35, 32), (576, 96), (1000, 128)] {
        let x = randn(&mut rng, 5 * dim);
        let w = randn(&mut rng, dim);
        let mut want = vec![0f32; x.len()];
        reference::rms_norm::rms_norm(&x, &w, &mut want, dim, 1e-5);
        let mut got = vec![f32::NAN; x.len()];
        metal_on_cpu::rms_norm(&x, &w, &mut got, dim, 1e-5, threads);
        let err = rel_l2(&got, &want);
        assert!(err < 1e-6, "dim {dim}, {threads} threads: relative error {err}");
    }
}

/// Rope settings of `dims` rotated dimensions, cosine and sine times `scale`.
fn rope_of(layout: RopeLayout, dims: usize, scale: f32) -> Rope {
    Rope {
        layout,
        theta: 10000.0,
        dims,
        scaling: RopeScaling::None,
        scale,
    }
}

#[test]
fn rope_matches_the_reference_in_both_layouts() {
    let mut rng = rng();
    let (n_heads, head_dim) = (9, 48);
    let positions = [0u32, 1, 17, 34, 200];
    for (layout, halves) in [(RopeLayout::Adjacent, false), (RopeLayout::Halves, true)] {
        // Every dimension or part of them (partial rotary), with and without an attention factor.
        for (dims, scale) in [(48, 1.0), (32, 1.0), (36, 1.27)] {
            let freqs = rope_of(layout, dims, scale).inverse_frequencies();
            let x = randn(&mut rng, positions.len() * n_heads * head_dim);
            let mut want = x.clone();
            reference::rope::rope(
                &mut want,
                &positions,
                &freqs,
                n_heads,
                head_dim,
                rope_of(layout, dims, scale),
            );
            let mut got = x.clone();
            metal_on_cpu::rope(&mut got, &positions, &freqs, n_heads, head_dim, dims, halves, scale, 16);
            let err = rel_l2(&got, &want);
            assert!(
                err < 1e-6,
                "{layout:?}, {dims} dims, scale {scale}: relative error {err}"
            );
            let untouched = |v: &[f32]| -> Vec<f32> { v.chunks(head_dim).flat_map(|h| h[dims..].to_vec()).collect() };
            assert_eq!(untouched(&got), untouched(&x), "dimensions past `dims` are not rotated");
        }
    }
}

#[test]
fn elementwise_ops_match_the_reference() {
    let mut rng = rng();
    let n = 1000; // not a multiple of the 64-thread groups
    let (a, b) = (randn(&mut rng, n), randn(&mut rng, n));
    for act in [Activation::Silu, Activation::GeluTanh] {
        let mut want = vec![0f32; n];
        reference::glu::glu(&a, &b, &mut want, act);
        let mut got = vec![f32::NAN; n];
        metal_on_cpu::glu(&a, &b, &mut got, act.code(), 64);
        assert!(rel_l2(&got, &want) < 1e-6, "{act:?}");
    }

    let (mut want, mut got) = (a.clone(), a.clone());
    reference::scale::scale(&mut want, 2.5);
    metal_on_cpu::scale(&mut got, 2.5, 64);
    assert_eq!(got, want);
    // A cap below some of the values (up to 1).
    let (mut want, mut got) = (a.clone(), a.clone());
    reference::scale::softcap(&mut want, 0.6);
    metal_on_cpu::softcap(&mut got, 0.6, 64);
    assert!(rel_l2(&got, &want) < 1e-6, "softcap");

    let (mut want, mut got) = (a.clone(), a.clone());
    reference::add::add(&mut want, &b);
    metal_on_cpu::add(&mut got, &b, 64);
    assert_eq!(got, want);

    let bias = randn(&mut rng, 40);
    let (mut want, mut got) = (a.clone(), a.clone());
    reference::add::add_bias(&mut want, &bias);
    metal_on_cpu::add_bias(&mut got, &bias, 64);
    assert_eq!(got, want);
}

#[test]
fn argmax_takes_the_first_of_equal_maxima() {
    let mut rng = rng();
    let width = 1001;
    let mut x = randn(&mut rng, 4 * width);
    x[width + 700] = 5.0;
    x[width + 300] = 5.0; // a tie in another simdgroup's stripe: the lower index wins
    x[2 * width..3 * width].fill(f32::NEG_INFINITY); // nothing above -inf: index 0
    x[3 * width..].fill(f32::NAN); // nor here: still a token id
    let want: Vec<u32> = x
        .chunks(width)
        .map(|row| {
            row.iter()
                .enumerate()
                .fold(0, |best, (i, &v)| if v > row[best] { i } else { best }) as u32
        })
        .collect();
    for threads in [32, 96, 256] {
        let mut got = vec![u32::MAX; 4];
        metal_on_cpu::argmax(&x, None, &mut got, threads);
        assert_eq!(got, want, "{threads} threads");
    }
}

#[test]
fn argmax_within_a_constraint_takes_the_largest_allowed_value() {
    let mut rng = rng();
    let width = 1001usize;
    let words = width.div_ceil(32);
    let x = randn(&mut rng, 3 * width);
    let mut allowed: Vec<u32> = (0..3 * words)
        .map(|_| rng.random::<u32>() & rng.random::<u32>())
        .collect();
    allowed[words - 1] |= 1 << (width % 32 - 1); // the row's last value may win
    allowed[words..].fill(0); // nothing allowed: index 0
    allowed[2 * words + 7] = 1 << 3; // one value allowed
    let want: Vec<u32> = x
        .chunks(width)
        .zip(allowed.chunks(words))
        .map(|(row, bits)| reference::argmax::argmax_within(row, bits))
        .collect();
    assert_eq!(want[1], 0);
    assert_eq!(want[2] as usize, 7 * 32 + 3);
    for threads in [32, 96, 256] {
        let mut got = vec![u32::MAX; 3];
        metal_on_cpu::argmax(&x, Some(&allowed), &mut got, threads);
        assert_eq!(got, want, "{threads} threads");
    }
}

/// A step of paged attention: sequences of `lens` positions in scrambled pages, their K and V rows
/// at every position, and the step's queries. By default the engine's tests' case: two sequences
/// in pages of 4, one prefilled at every position (so the causal mask matters) next to decodes of
/// the other.
struct Paged {
    shape: AttentionShape,
    case: PagedCase,
    tables: Vec<u32>,
    positions: Vec<u32>,
    token_seqs: Vec<u32>,
    q: Vec<f32>,
    /// Every sequence's K and V rows, by token.
    k: Vec<f32>,
    v: Vec<f32>,
    k_positions: Vec<u32>,
    k_seqs: Vec<u32>,
}

impl Paged {
    fn new(rng: &mut ChaCha8Rng) -> Paged {
        let shape = AttentionShape {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 48,
        };
        Paged::with(rng, shape, 4, &PAGED_LENS, &paged_queries())
    }

    /// Sequences of `lens` positions in pages of `page_size`, queried at `(sequence, position)`.
    fn with(
        rng: &mut ChaCha8Rng,
        shape: AttentionShape,
        page_size: usize,
        lens: &[usize],
        queries: &[(u32, u32)],
    ) -> Paged {
        let case = PagedCase::new(rng, page_size, lens);
        let (mut k_positions, mut k_seqs) = (Vec::new(), Vec::new());
        for (seq, &len) in lens.iter().enumerate() {
            k_positions.extend(0..len as u32);
            k_seqs.extend(std::iter::repeat_n(seq as u32, len));
        }
        let n_kv = k_positions.len() * shape.kv_width();
        Paged {
            tables: case.flat_tables(),
            positions: queries.iter().map(|&(_, p)| p).collect(),
            token_seqs: queries.iter().map(|&(s, _)| s).collect(),
            q: randn(rng, queries.len() * shape.q_width()),
            k: randn(rng, n_kv),
            v: randn(rng, n_kv),
            k_positions,
            k_seqs,
            shape,
            case,
        }
    }

    fn heads(&self) -> Heads {
        Heads {
            n_heads: self.shape.n_heads,
            n_kv_heads: self.shape.n_kv_heads,
            head_dim: self.shape.head_dim,
        }
    }

    fn cache_len(&self) -> usize {
        self.case.n_pages * self.case.page_size * self.shape.kv_width()
    }

    fn pages<'a>(&'a self, positions: &'a [u32], token_seqs: &'a [u32]) -> Pages<'a> {
        Pages {
            positions,
            tables: &self.tables,
            table_width: self.case.table_width() as u32,
            token_seqs,
            page_size: self.case.page_size as u32,
        }
    }

    /// The reference: f32 caches filled by the CPU kv_write, then CPU attention under `rule`.
    fn reference(&self, rule: Scores) -> Vec<f32> {
        let width = self.case.table_width();
        let (mut kc, mut vc) = (vec![f32::NAN; self.cache_len()], vec![f32::NAN; self.cache_len()]);
        let n_pages = self.case.n_pages;
        let page_size = self.case.page_size;
        let write = PageMap::new(&self.tables, width, &self.k_seqs, page_size, &self.k_positions, n_pages).unwrap();
        let kv_width = self.shape.kv_width();
        reference::kv_write::kv_write(&self.k, &self.v, &mut kc, &mut vc, &self.k_positions, &write, kv_width);
        let read = PageMap::new(
            &self.tables,
            width,
            &self.token_seqs,
            page_size,
            &self.positions,
            n_pages,
        )
        .unwrap();
        let mut out = vec![0f32; self.q.len()];
        reference::attention::attention(&self.q, &kc, &vc, &self.positions, &read, &mut out, self.shape, rule);
        out
    }

    /// Caches written by the Metal kv_write (f32, or f16 bits), unwritten rows NaN.
    fn caches(&self, f16_cache: bool) -> (Vec<f32>, Vec<f32>, Vec<u16>, Vec<u16>) {
        let n = self.cache_len();
        let nan16 = f16::NAN.to_bits();
        let (mut k32, mut v32, mut k16, mut v16) =
            (vec![f32::NAN; n], vec![f32::NAN; n], vec![nan16; n], vec![nan16; n]);
        let pages = self.pages(&self.k_positions, &self.k_seqs);
        let kv_width = self.shape.kv_width();
        if f16_cache {
            metal_on_cpu::kv_write(
                &self.k,
                &self.v,
                Cache::F16(&mut k16),
                Cache::F16(&mut v16),
                pages,
                kv_width,
                64,
            );
        } else {
            metal_on_cpu::kv_write(
                &self.k,
                &self.v,
                Cache::F32(&mut k32),
                Cache::F32(&mut v32),
                pages,
                kv_width,
                64,
            );
        }
        (k32, v32, k16, v16)
    }
}

#[test]
fn rope_kv_write_matches_rope_then_kv_write() {
    let mut rng = rng();
    let case = Paged::new(&mut rng);
    let (heads, n) = (case.heads(), case.k_positions.len());
    let head_dim = heads.head_dim;
    let q = randn(&mut rng, n * case.shape.q_width());
    // Every dimension rotated, and part of them with an attention factor (YaRN's, LongRoPE's).
    let settings = [
        (RopeLayout::Adjacent, head_dim, 1.0),
        (RopeLayout::Halves, head_dim, 1.0),
        (RopeLayout::Halves, head_dim * 3 / 4, 1.19),
        (RopeLayout::Adjacent, head_dim / 2, 0.93),
    ];
    for (layout, dims, scale) in settings {
        let halves = layout == RopeLayout::Halves;
        let rope = rope_of(layout, dims, scale);
        let freqs = rope.inverse_frequencies();
        // The reference: rope on Q and K, then kv_write into f32 caches.
        let (mut want_q, mut want_k) = (q.clone(), case.k.clone());
        reference::rope::rope(&mut want_q, &case.k_positions, &freqs, heads.n_heads, head_dim, rope);
        reference::rope::rope(&mut want_k, &case.k_positions, &freqs, heads.n_kv_heads, head_dim, rope);
        let (mut want_kc, mut want_vc) = (vec![f32::NAN; case.cache_len()], vec![f32::NAN; case.cache_len()]);
        let map = PageMap::new(
            &case.tables,
            case.case.table_width(),
            &case.k_seqs,
            case.case.page_size,
            &case.k_positions,
            case.case.n_pages,
        )
        .unwrap();
        let kv_width = case.shape.kv_width();
        reference::kv_write::kv_write(
            &want_k,
            &case.v,
            &mut want_kc,
            &mut want_vc,
            &case.k_positions,
            &map,
            kv_width,
        );
        for f16_cache in [false, true] {
            let (mut got_q, mut got_k) = (q.clone(), case.k.clone());
            let n_cache = case.cache_len();
            let nan16 = f16::NAN.to_bits();
            let (mut k32, mut v32, mut k16, mut v16) = (
                vec![f32::NAN; n_cache],
                vec![f32::NAN; n_cache],
                vec![nan16; n_cache],
                vec![nan16; n_cache],
            );
            let pages = case.pages(&case.k_positions, &case.k_seqs);
            let (kc, vc) = (
                cache(f16_cache, &mut k32, &mut k16),
                cache(f16_cache, &mut v32, &mut v16),
            );
            metal_on_cpu::rope_kv_write(
                &mut got_q, &mut got_k, &case.v, kc, vc, &freqs, pages, heads, dims, halves, scale, 32,
            );
            assert!(
                rel_l2(&got_q, &want_q) < 1e-6,
                "{layout:?}, {dims} dims: rotated queries"
            );
            let widen = |c: &[u16]| -> Vec<f32> { c.iter().map(|&b| f16::from_bits(b).to_f32()).collect() };
            let (got_kc, got_vc) = if f16_cache {
                (widen(&k16), widen(&v16))
            } else {
                (k32, v32)
            };
            for (got, want, what) in [(&got_kc, &want_kc, "K"), (&got_vc, &want_vc, "V")] {
                let written: Vec<usize> = (0..want.len()).filter(|&i| want[i].is_finite()).collect();
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(i, v)| v.is_finite() == want[i].is_finite()),
                    "{what}: rows written elsewhere"
                );
                let pick = |c: &[f32]| -> Vec<f32> { written.iter().map(|&i| c[i]).collect() };
                let err = rel_l2(&pick(got), &pick(want));
                assert!(
                    err < tolerance(f16_cache),
                    "{layout:?}, {dims} dims, f16 cache {f16_cache}: {what} relative error {err}"
                );
            }
        }
    }
}

/// f16 caches round K and V: the error that leaves (about 2^-11 relative per value).
fn tolerance(f16_cache: bool) -> f64 {
    if f16_cache {
        2e-3
    } else {
        1e-5
    }
}

/// Causal attention, then every rule of `score_rules`.
fn rules(head_dim: usize) -> Vec<Scores> {
    std::iter::once(Scores::causal(head_dim))
        .chain(score_rules(head_dim))
        .collect()
}

/// A rule's name in the tests made per rule: `causal`, `window_<positions>`, `softcap`, `scale`,
/// or `capped_window` for all three.
fn describe(rule: Scores, head_dim: usize) -> String {
    let causal = Scores::causal(head_dim);
    match (rule.scale == causal.scale, rule.softcap, rule.window) {
        (true, None, None) => "causal".into(),
        (true, None, Some(w)) => format!("window_{w}"),
        (true, Some(_), None) => "softcap".into(),
        (false, None, None) => "scale".into(),
        (false, Some(_), Some(_)) => "capped_window".into(),
        _ => panic!("a score rule the tests have no name for: {rule:?}"),
    }
}

/// The rule of `rules(head_dim)` that `describe` names `name`.
fn named_rule(name: &str, head_dim: usize) -> Scores {
    rules(head_dim)
        .into_iter()
        .find(|&r| describe(r, head_dim) == name)
        .unwrap_or_else(|| panic!("no score rule is named {name}"))
}

/// Calls `$then!` with the names of the rules every attention kernel is tested under, after its
/// own arguments: one list for the tests made per rule and for the check that it names them all.
macro_rules! with_rule_names {
    ($then:ident $(, $arg:ident)*) => {
        $then!($($arg,)* causal window_1 window_3 window_37 window_100 window_10000 softcap scale capped_window);
    };
}

macro_rules! rule_name_list {
    ($($rule:ident)+) => {
        const RULE_NAMES: &[&str] = &[$(stringify!($rule)),+];
    };
}
with_rule_names!(rule_name_list);

/// A module of tests `$check::<rule>::<f32|f16>_cache`, each calling `$check(rule name, f16
/// cache)`, so that a filter picks one rule and one cache type (scripts/metal_planted_bugs.sh).
macro_rules! tests_per_rule {
    ($check:ident, $($rule:ident)+) => {
        mod $check {
            $(mod $rule {
                #[test]
                fn f32_cache() {
                    crate::$check(stringify!($rule), false);
                }
                #[test]
                fn f16_cache() {
                    crate::$check(stringify!($rule), true);
                }
            })+
        }
    };
}

#[test]
fn the_attention_tests_cover_every_score_rule() {
    let named: Vec<String> = rules(48).into_iter().map(|r| describe(r, 48)).collect();
    assert_eq!(
        named, RULE_NAMES,
        "the rules of `score_rules` and the tests made per rule differ"
    );
}

/// Every threadgroup size of `sizes` for causal attention, the middle one for the other rules
/// (each GPU thread is a fiber on the CPU: a run is slow).
fn sizes_for(rule: Scores, head_dim: usize, sizes: [u32; 3]) -> Vec<u32> {
    if rule == Scores::causal(head_dim) {
        sizes.to_vec()
    } else {
        vec![sizes[1]]
    }
}

/// A rule as the kernels take it.
fn kernel_rule(rule: Scores) -> Rule {
    let args = rule.kernel_args().unwrap();
    Rule {
        scale: args.scale,
        softcap: args.softcap,
        window: args.window as u32,
    }
}

/// kv_write, then the fused one-pass attention (decode's), against the reference.
fn fused_attention(rule_name: &str, f16_cache: bool) {
    let mut rng = rng();
    let case = Paged::new(&mut rng);
    let rule = named_rule(rule_name, case.shape.head_dim);
    let want = case.reference(rule);
    let (mut k32, mut v32, mut k16, mut v16) = case.caches(f16_cache);
    for simds in sizes_for(rule, case.shape.head_dim, [1, 3, 8]) {
        let mut got = vec![f32::NAN; want.len()];
        let pages = case.pages(&case.positions, &case.token_seqs);
        let (kc, vc) = (
            cache(f16_cache, &mut k32, &mut k16),
            cache(f16_cache, &mut v32, &mut v16),
        );
        metal_on_cpu::attention(&case.q, kc, vc, pages, &mut got, case.heads(), kernel_rule(rule), simds);
        let err = rel_l2(&got, &want);
        assert!(
            err < tolerance(f16_cache),
            "f16 cache {f16_cache}, {simds} simdgroups, {rule:?}: relative error {err}"
        );
    }
}
with_rule_names!(tests_per_rule, fused_attention);

/// The two-pass attention: its scores masked causally and by window (exactly -inf), then its
/// output against the reference.
fn attention_pair(rule_name: &str, f16_cache: bool) {
    let mut rng = rng();
    let case = Paged::new(&mut rng);
    let rule = named_rule(rule_name, case.shape.head_dim);
    let n_ctx = 35; // the longest sequence
    let rows = case.positions.len() * case.shape.n_heads;
    let want = case.reference(rule);
    let (mut k32, mut v32, mut k16, mut v16) = case.caches(f16_cache);
    let mut scores = vec![f32::NAN; rows * n_ctx];
    let pages = case.pages(&case.positions, &case.token_seqs);
    let kc = cache(f16_cache, &mut k32, &mut k16);
    metal_on_cpu::attention_qk(
        &case.q,
        kc,
        pages,
        &mut scores,
        case.heads(),
        n_ctx,
        kernel_rule(rule),
        16,
    );
    for (row, s) in scores.chunks(n_ctx).enumerate() {
        let pos = case.positions[row / case.shape.n_heads] as usize;
        let first = rule.first_visible(pos);
        assert!(
            s[first..=pos].iter().all(|v| v.is_finite()),
            "row {row}, {rule:?}: a visible score is missing"
        );
        assert!(
            s[..first].iter().chain(&s[pos + 1..]).all(|&v| v == f32::NEG_INFINITY),
            "row {row}, {rule:?}: scores outside positions {first}..={pos} must be exactly -inf"
        );
    }
    for threads in sizes_for(rule, case.shape.head_dim, [32, 64, 128]) {
        let mut got = vec![f32::NAN; want.len()];
        let vc = cache(f16_cache, &mut v32, &mut v16);
        metal_on_cpu::attention_pv(&scores, vc, pages, &mut got, case.heads(), n_ctx, threads);
        let err = rel_l2(&got, &want);
        assert!(
            err < tolerance(f16_cache),
            "f16 cache {f16_cache}, {threads} threads, {rule:?}: relative error {err}"
        );
    }
}
with_rule_names!(tests_per_rule, attention_pair);

/// A prompt step at sizes the prompt attention's tiles do not divide: sequences with contexts of
/// 7, 1, 64 and 200 positions (pages of 16), the first two prefilled whole, then the last 23
/// positions of the third and the last 39 of the fourth (chunks after their cached starts). 70
/// tokens: the first tile of 32 queries holds all four sequences, windows and contexts cross
/// tiles of keys, and the last tile is partial.
fn prompt_step(rng: &mut ChaCha8Rng, shape: AttentionShape) -> Paged {
    let mut queries: Vec<(u32, u32)> = (0..7).map(|p| (0, p)).collect();
    queries.push((1, 0));
    queries.extend((41..64).map(|p| (2, p)));
    queries.extend((161..200).map(|p| (3, p)));
    Paged::with(rng, shape, 16, &[7, 1, 64, 200], &queries)
}

/// `flash_attention` in the kernel for heads of up to `head_max`, against the reference.
fn check_flash_attention(case: &Paged, rule: Scores, f16_cache: bool, head_max: usize) {
    let want = case.reference(rule);
    let (mut k32, mut v32, mut k16, mut v16) = case.caches(f16_cache);
    let mut got = vec![f32::NAN; want.len()];
    let pages = case.pages(&case.positions, &case.token_seqs);
    let (kc, vc) = (
        cache(f16_cache, &mut k32, &mut k16),
        cache(f16_cache, &mut v32, &mut v16),
    );
    metal_on_cpu::flash_attention(
        &case.q,
        kc,
        vc,
        pages,
        &mut got,
        case.heads(),
        kernel_rule(rule),
        head_max,
    );
    let err = rel_l2(&got, &want);
    let head_dim = case.shape.head_dim;
    assert!(
        err < tolerance(f16_cache),
        "heads of {head_dim} in the kernel for {head_max}, f16 cache {f16_cache}, {rule:?}: relative error {err}"
    );
}

/// Heads of 48, in groups of three over each KV head.
const GQA_48: AttentionShape = AttentionShape {
    n_heads: 6,
    n_kv_heads: 2,
    head_dim: 48,
};

/// The prompt attention (flash), 6 heads of 48 over 2, in the kernel for heads of up to 64.
fn flash_attention(rule_name: &str, f16_cache: bool) {
    let mut rng = rng();
    let case = prompt_step(&mut rng, GQA_48);
    check_flash_attention(&case, named_rule(rule_name, GQA_48.head_dim), f16_cache, 64);
}
with_rule_names!(tests_per_rule, flash_attention);

/// Heads padded in the wider kernels: 48 in those for 128 and 256 (tiles of 16 keys), and 80,
/// not a whole number of 16, in that for 128.
#[test]
fn flash_attention_pads_heads_in_every_class() {
    let mut rng = rng();
    for (head_dim, head_max) in [(48, 128), (48, 256), (80, 128)] {
        let shape = AttentionShape { head_dim, ..GQA_48 };
        let case = prompt_step(&mut rng, shape);
        check_flash_attention(&case, Scores::causal(head_dim), false, head_max);
    }
}

/// Gemma 3's heads (4 of 256 over one), causal as its global layers and a capped window.
#[test]
fn flash_attention_at_gemma_3s_heads() {
    let mut rng = rng();
    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
    };
    let case = prompt_step(&mut rng, shape);
    for rule in [Scores::causal(256), capped_window()] {
        check_flash_attention(&case, rule, true, 256);
    }
}

/// Two short sequences in one partial tile, small enough for ThreadSanitizer to watch the staging
/// and the barriers (scripts/metal_planted_bugs.sh) in seconds.
#[test]
fn flash_attention_one_partial_tile_matches_the_reference() {
    let mut rng = rng();
    let shape = AttentionShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 48,
    };
    let queries: Vec<(u32, u32)> = (0..5).map(|p| (0, p)).chain((0..3).map(|p| (1, p))).collect();
    let case = Paged::with(&mut rng, shape, 4, &[5, 3], &queries);
    check_flash_attention(&case, Scores::causal(48), false, 64);
}

/// A cache layer in the kind under test.
fn cache<'a>(f16_cache: bool, c32: &'a mut [f32], c16: &'a mut [u16]) -> Cache<'a> {
    match f16_cache {
        true => Cache::F16(c16),
        false => Cache::F32(c32),
    }
}

/// Router logits for `n_tokens` tokens of `n_experts`, rounded to halves so that a row holds exact
/// ties, and the last row all equal.
fn tied_logits(rng: &mut ChaCha8Rng, n_tokens: usize, n_experts: usize) -> Vec<f32> {
    let mut logits: Vec<f32> = randn(rng, n_tokens * n_experts)
        .iter()
        .map(|v| (v * 4.0).round() / 2.0)
        .collect();
    let last = logits.len() - n_experts;
    logits[last..].fill(0.5);
    logits
}

/// The reference's routes of `logits`: ids and weights.
fn reference_routes(logits: &[f32], routing: Routing) -> (Vec<u32>, Vec<f32>) {
    let n = logits.len() / routing.n_experts * routing.k;
    let (mut ids, mut weights) = (vec![0u32; n], vec![0f32; n]);
    reference::route::route(logits, routing, &mut ids, &mut weights);
    (ids, weights)
}

/// Routing over 6 experts (fewer than a simdgroup's lanes) and 40 (some lanes hold two), top-2
/// and all, renormalized (Mixtral, Qwen's `norm_topk_prob`) or not, for 1, 7 and 33 tokens whose
/// logits hold exact ties: the same ids as the reference, lowest index first among equals.
#[test]
fn route_matches_the_reference_with_ties() {
    let mut rng = rng();
    for (n_experts, k) in [(6, 2), (6, 6), (40, 3)] {
        for n_tokens in [1, 7, 33] {
            let logits = tied_logits(&mut rng, n_tokens, n_experts);
            for renormalize in [true, false] {
                let routing = Routing {
                    n_experts,
                    k,
                    renormalize,
                };
                let (want_ids, want_weights) = reference_routes(&logits, routing);
                let (mut ids, mut weights) = (vec![u32::MAX; n_tokens * k], vec![f32::NAN; n_tokens * k]);
                metal_on_cpu::route(&logits, n_experts, k, renormalize, &mut ids, &mut weights);
                let case = format!("{k} of {n_experts}, {n_tokens} tokens, renormalize {renormalize}");
                assert_eq!(ids, want_ids, "{case}");
                let err = rel_l2(&weights, &want_weights);
                assert!(err < 1e-6, "{case}: weights' relative error {err}");
            }
        }
    }
}

/// The expert op on the shim and in the reference, 6 experts of which each token runs 2, routed
/// by the reference from tied logits: gate, up and down in `[ty, up_ty, down_ty]` (Q4_K_M mixes
/// gate and down; gate and up of one type run in one kernel).
fn check_experts(rng: &mut ChaCha8Rng, [ty, up_ty, down_ty]: [GgmlType; 3], act: Activation, n_tokens: usize) {
    let (n_experts, k) = (6, 2);
    // The model's width holds whole blocks of the gate and up type, the experts' of the down type.
    let (dim, width) = (
        awkward_dim(ty),
        (awkward_dim(down_ty) / 3).next_multiple_of(down_ty.block_len()),
    );
    let gate = random_weight_bytes(rng, ty, n_experts * dim * width);
    let up = random_weight_bytes(rng, up_ty, n_experts * dim * width);
    let down = random_weight_bytes(rng, down_ty, n_experts * width * dim);
    let routing = Routing {
        n_experts,
        k,
        renormalize: true,
    };
    let (ids, weights) = reference_routes(&tied_logits(rng, n_tokens, n_experts), routing);
    let x = randn(rng, n_tokens * dim);
    let residual = randn(rng, n_tokens * dim);

    let stacks = [
        (ty, &gate[..], dim, width),
        (up_ty, &up[..], dim, width),
        (down_ty, &down[..], width, dim),
    ];
    let mut want = residual.clone();
    let reference_experts = reference_experts(stacks, n_experts);
    reference::experts::experts(&x, &reference_experts, &ids, &weights, k, act, &mut want);
    let [gate, up, down] = stacks.map(|(ty, bytes, n_in, n_out)| ExpertStack {
        ty: ty.id(),
        bytes,
        row_bytes: ty.row_bytes(n_in),
        n_in,
        n_out,
    });
    let experts = Experts {
        gate,
        up,
        down,
        act: act.code(),
    };
    let mut got = residual;
    metal_on_cpu::experts(experts, &x, &ids, &weights, k, &mut got, 4);
    let err = rel_l2(&got, &want);
    assert!(
        err < 1e-5,
        "{ty}, {up_ty} and {down_ty}, {n_tokens} tokens: relative error {err}"
    );
}

/// The reference's experts over stacks of gate, up and down matrices: (type, bytes, n_in, n_out).
fn reference_experts<'a>(stacks: [(GgmlType, &'a [u8], usize, usize); 3], n_experts: usize) -> Vec<Expert<'a>> {
    let part = |e: usize, (ty, bytes, n_in, n_out): (GgmlType, &'a [u8], usize, usize)| {
        let size = ty.row_bytes(n_in) * n_out;
        ExpertMatrix {
            ty,
            bytes: &bytes[e * size..(e + 1) * size],
            n_in,
            n_out,
        }
    };
    (0..n_experts)
        .map(|e| Expert {
            gate: part(e, stacks[0]),
            up: part(e, stacks[1]),
            down: part(e, stacks[2]),
        })
        .collect()
}

/// A model width that is not a multiple of the 32 lanes in blocks (elements for floats): 96, or
/// one block of 256 values (for the experts' width, a third of it: 32, or 256 again).
fn awkward_dim(ty: GgmlType) -> usize {
    match ty.block_len() {
        256 => 256,
        _ => 96,
    }
}

/// One token through every weight type, the down matrices of the next type in the list (so
/// that a layer of mixed types, as Q4_K_M writes, is covered too).
#[test]
fn experts_every_type_match_the_reference() {
    let mut rng = rng();
    let types = weight_types();
    for (i, &ty) in types.iter().enumerate() {
        check_experts(&mut rng, [ty, ty, types[(i + 1) % types.len()]], Activation::Silu, 1);
    }
}

/// Several tokens, each reading its own row of the input and its own experts: gate and up of
/// different types (a kernel for each, then the activation) with GELU, and of one type.
#[test]
fn experts_over_7_and_33_tokens_match_the_reference() {
    let mut rng = rng();
    let (q8, q4) = (GgmlType::Q8_0, GgmlType::Q4_0);
    check_experts(&mut rng, [q8, q4, q4], Activation::GeluTanh, 7);
    check_experts(&mut rng, [q8, q8, q4], Activation::Silu, 33);
}

/// An expert id outside the set (which `route` never writes) makes the token's rows NaN rather
/// than reading past the stack.
#[test]
fn an_expert_id_outside_the_set_makes_nan_rows() {
    let (n_in, n_out) = (32, 32);
    let bytes = vec![0u8; 2 * n_out * n_in * 4];
    let stack = ExpertStack {
        ty: GgmlType::F32.id(),
        bytes: &bytes,
        row_bytes: n_in * 4,
        n_in,
        n_out,
    };
    let x = vec![1f32; 2 * n_in];
    let mut out = vec![0f32; 2 * n_out];
    metal_on_cpu::matmul_experts(stack, &[1, 2], &x, 1, &mut out, 1);
    assert!(out[..n_out].iter().all(|&v| v == 0.0), "expert 1 of 2 ran");
    assert!(
        out[n_out..].iter().all(|v| v.is_nan()),
        "expert 2 of 2 did not make NaN"
    );
}

/// The gated shared expert's add, over 33 rows of 96.
#[test]
fn add_gated_matches_the_reference() {
    let mut rng = rng();
    let (n_tokens, width) = (33, 96);
    let (x, rows, gates) = (
        randn(&mut rng, n_tokens * width),
        randn(&mut rng, n_tokens * width),
        randn(&mut rng, n_tokens).iter().map(|g| 4.0 * g).collect::<Vec<_>>(),
    );
    let mut want = x.clone();
    reference::add::add_gated(&mut want, &rows, &gates, width);
    let mut got = x;
    metal_on_cpu::add_gated(&mut got, &rows, &gates, 64);
    let err = rel_l2(&got, &want);
    assert!(err < 1e-6, "relative error {err}");
}
