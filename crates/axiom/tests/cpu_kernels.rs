//! The CPU reference kernels through the `Backend` interface, against independent formulas at
//! awkward sizes (head_dim 48, 35 positions, 9 heads over 3 KV heads, rows not a multiple of
//! anything). GPU backends run the same shapes against these kernels.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use axiom::backend::cpu::fast::{has_int8_kernel, quantize_row, Isa, Q8Activations, CHUNK, GROUPS_PER_CHUNK};
use axiom::backend::cpu::{CpuBackend, CpuKernels};
use axiom::backend::{
    Activation, AttentionKv, AttentionShape, Backend, BlockHandle, HostTensor, Kernels, KvType, PagedKv, Rope,
    RopeLayout, RopeScaling, Scores,
};
use axiom::format::quant::{dequantize, GgmlType};
use half::f16;
mod common;

use common::{paged_attention_by_matrix, paged_queries, random_weight_bytes, score_rules, PagedCase, PAGED_LENS};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(1234)
}

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn backend() -> CpuBackend {
    let mut b = CpuBackend::reference(3);
    b.reserve(64 << 20).unwrap();
    b
}

/// Allocates a block holding `data`.
fn upload(b: &mut CpuBackend, data: &[f32]) -> BlockHandle {
    let h = b.alloc(data.len() * 4).unwrap();
    b.write_f32(h, data).unwrap();
    h
}

/// A block of `n` f32 poisoned with NaN, so an unwritten output fails.
fn poisoned(b: &mut CpuBackend, n: usize) -> BlockHandle {
    upload(b, &vec![f32::NAN; n])
}

fn upload_u32(b: &mut CpuBackend, data: &[u32]) -> BlockHandle {
    let h = b.alloc(data.len() * 4).unwrap();
    b.write_u32(h, data).unwrap();
    h
}

fn read(b: &CpuBackend, h: BlockHandle, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    b.read_f32(h, &mut out).unwrap();
    out
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn matmul_every_type_matches_dequantize_then_multiply() {
    let mut r = rng();
    for ty in GgmlType::ALL.into_iter().chain([GgmlType::Fp8]) {
        let n_in = if ty.block_len() == 256 { 512 } else { 96 };
        let n_out = 37;
        let bytes = random_weight_bytes(&mut r, ty, n_in * n_out);
        let mut dense = vec![0f32; n_in * n_out];
        dequantize(ty, &bytes, &mut dense);
        for n_tokens in [1, 35] {
            let mut b = backend();
            let w = b
                .upload_weight(&HostTensor {
                    name: "w",
                    ty,
                    dims: &[n_in, n_out],
                    bytes: &bytes,
                    region: None,
                })
                .unwrap();
            let x = randn(&mut r, n_tokens * n_in);
            let xh = upload(&mut b, &x);
            let out = poisoned(&mut b, n_tokens * n_out);
            b.matmul(xh, &w, out, n_tokens).unwrap();
            let want: Vec<f32> = (0..n_tokens * n_out)
                .map(|i| {
                    let (t, o) = (i / n_out, i % n_out);
                    (0..n_in)
                        .map(|k| x[t * n_in + k] as f64 * dense[o * n_in + k] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            assert_close(
                &read(&b, out, n_tokens * n_out),
                &want,
                1e-4,
                &format!("{ty} x {n_tokens} tokens"),
            );
        }
    }
}

#[test]
fn embed_dequantizes_the_rows_asked_for() {
    let mut r = rng();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::F16, GgmlType::Q6K] {
        let (dim, vocab) = (256, 11);
        let bytes = random_weight_bytes(&mut r, ty, dim * vocab);
        let mut dense = vec![0f32; dim * vocab];
        dequantize(ty, &bytes, &mut dense);
        let mut b = backend();
        let table = b
            .upload_weight(&HostTensor {
                name: "e",
                ty,
                dims: &[dim, vocab],
                bytes: &bytes,
                region: None,
            })
            .unwrap();
        let ids = [3u32, 0, 10, 3];
        let idh = upload_u32(&mut b, &ids);
        let out = poisoned(&mut b, ids.len() * dim);
        b.embed(&table, idh, out, ids.len()).unwrap();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| dense[i as usize * dim..][..dim].to_vec())
            .collect();
        assert_eq!(read(&b, out, want.len()), want, "{ty}");
        // An id past the vocabulary is an error, not a read out of bounds.
        let bad = upload_u32(&mut b, &[11]);
        assert!(b.embed(&table, bad, out, 1).is_err());
    }
}

#[test]
fn rms_norm_matches_the_formula() {
    let mut r = rng();
    let (n, dim) = (5, 48);
    let x = randn(&mut r, n * dim);
    let w = randn(&mut r, dim);
    let mut b = backend();
    let (xh, wh, out) = (upload(&mut b, &x), upload(&mut b, &w), poisoned(&mut b, n * dim));
    b.rms_norm(xh, wh, out, n, dim, 1e-5).unwrap();
    let mut want = vec![0f32; n * dim];
    for t in 0..n {
        let row = &x[t * dim..][..dim];
        let rms = (row.iter().map(|v| v * v).sum::<f32>() / dim as f32 + 1e-5).sqrt();
        for i in 0..dim {
            want[t * dim + i] = row[i] / rms * w[i];
        }
    }
    assert_close(&read(&b, out, n * dim), &want, 1e-5, "rms_norm");
}

#[test]
fn rope_rotates_pairs_by_position() {
    let mut r = rng();
    let (n_heads, head_dim, n) = (3, 48, 4);
    let x = randn(&mut r, n * n_heads * head_dim);
    let positions = [0u32, 1, 7, 34];
    // Every dimension, or part of them with cosine and sine scaled (YaRN's attention factor).
    for (layout, dims, scale) in [
        (RopeLayout::Adjacent, head_dim, 1.0),
        (RopeLayout::Halves, head_dim, 1.0),
        (RopeLayout::Halves, 36, 1.25),
    ] {
        let rope = Rope {
            layout,
            theta: 10000.0,
            dims,
            scaling: RopeScaling::None,
            scale,
        };
        let mut b = backend();
        let (xh, ph) = (upload(&mut b, &x), upload_u32(&mut b, &positions));
        let fh = upload(&mut b, &rope.inverse_frequencies());
        b.rope(xh, ph, fh, n, n_heads, head_dim, rope).unwrap();
        let got = read(&b, xh, x.len());
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..n_heads {
                let base = (t * n_heads + h) * head_dim;
                for i in 0..dims / 2 {
                    let (a, c) = match layout {
                        RopeLayout::Adjacent => (2 * i, 2 * i + 1),
                        RopeLayout::Halves => (i, i + dims / 2),
                    };
                    let angle = pos as f32 * 10000f32.powf(-((2 * i) as f32) / dims as f32);
                    let (cos, sin) = (scale * angle.cos(), scale * angle.sin());
                    let (x0, x1) = (x[base + a], x[base + c]);
                    let want0 = x0 * cos - x1 * sin;
                    let want1 = x0 * sin + x1 * cos;
                    assert!((got[base + a] - want0).abs() < 1e-4 && (got[base + c] - want1).abs() < 1e-4);
                }
                // Dimensions past the rotated ones pass through.
                assert_eq!(&got[base + dims..base + head_dim], &x[base + dims..base + head_dim]);
            }
        }
        // Position 0 only scales the rotated dimensions.
        let unrotated: Vec<f32> = (0..n_heads * head_dim)
            .map(|j| if j % head_dim < dims { x[j] * scale } else { x[j] })
            .collect();
        assert_eq!(&got[..n_heads * head_dim], &unrotated[..]);
    }
}

/// Two sequences over scrambled pages; a step that prefills the first (every position, so the
/// causal mask matters) and decodes the second, with pages of 4 and of 16 positions, causal and
/// under every rule of `score_rules`.
fn paged_attention_case<B: Backend>(mut make: impl FnMut() -> B, tol: f32, what: &str) {
    let mut r = rng();
    let shape = AttentionShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 48,
    };
    let kv_w = shape.kv_width();
    let rules = std::iter::once(Scores::causal(shape.head_dim)).chain(score_rules(shape.head_dim));
    for (page_size, rule) in rules.flat_map(|rule| [(4, rule), (16, rule)]) {
        let case = PagedCase::new(&mut r, page_size, &PAGED_LENS).scored(rule);
        let k: Vec<Vec<f32>> = PAGED_LENS.iter().map(|l| randn(&mut r, l * kv_w)).collect();
        let v: Vec<Vec<f32>> = PAGED_LENS.iter().map(|l| randn(&mut r, l * kv_w)).collect();
        let queries = paged_queries();
        let q = randn(&mut r, queries.len() * shape.q_width());
        let mut b = make();
        let got = case.attention(&mut b, &k, &v, &queries, &q, shape).unwrap();
        // An f16 cache holds K and V rounded to f16; the formula sees the same values.
        let round = |x: &Vec<f32>| -> Vec<f32> {
            match b.kv_type() {
                KvType::F32 => x.clone(),
                KvType::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            }
        };
        let (k, v): (Vec<_>, Vec<_>) = (k.iter().map(round).collect(), v.iter().map(round).collect());
        let want = paged_attention_by_matrix(&k, &v, &queries, &q, shape, rule);
        assert_close(&got, &want, tol, &format!("{what}, pages of {page_size}, {rule:?}"));
    }
}

#[test]
fn attention_over_paged_caches_is_causal_grouped_and_matches_the_matrix_form() {
    paged_attention_case(backend, 1e-5, "reference attention");
}

#[test]
fn kv_write_and_attention_refuse_tables_that_point_outside_the_cache() {
    let mut b = backend();
    let kv_w = 12;
    let (k, v) = (upload(&mut b, &[1.0; 12]), upload(&mut b, &[2.0; 12]));
    let page_size = 4;
    // Two pages of cache.
    let (kc, vc) = (
        b.alloc(2 * page_size * kv_w * 4).unwrap(),
        b.alloc(2 * page_size * kv_w * 4).unwrap(),
    );
    let pages = |b: &mut CpuBackend, table: &[u32], seq: u32| PagedKv {
        block_tables: upload_u32(b, table),
        table_width: table.len(),
        token_seqs: upload_u32(b, &[seq]),
        page_size,
    };
    let cases: [(&[u32], u32, u32, &str); 4] = [
        (&[1, 0], 0, 7, "a position in the last page is fine"),
        (&[1, 0], 0, 8, "a position beyond the table"),
        (&[1, 2], 0, 5, "a page beyond the cache"),
        (&[1, 0], 1, 0, "a sequence without a table"),
    ];
    for (i, (table, seq, pos, what)) in cases.into_iter().enumerate() {
        let p = pages(&mut b, table, seq);
        let ph = upload_u32(&mut b, &[pos]);
        let kv = AttentionKv {
            k_cache: kc,
            v_cache: vc,
            positions: ph,
            pages: p,
            scores: Scores::causal(4),
            plan: &(),
        };
        let result = b.kv_write(k, v, kv, 1, kv_w);
        assert_eq!(result.is_ok(), i == 0, "{what}: {result:?}");
    }
    // The write landed in page 0 (the table's second entry), row 3.
    let kc_all = read(&b, kc, 2 * page_size * kv_w);
    assert_eq!(&kc_all[3 * kv_w..4 * kv_w], &[1.0; 12]);
}

#[test]
fn attention_refuses_score_rules_that_weigh_nothing() {
    let mut r = rng();
    let shape = AttentionShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 8,
    };
    let k = vec![randn(&mut r, 3 * shape.kv_width())];
    let q = randn(&mut r, shape.q_width());
    let causal = Scores::causal(shape.head_dim);
    let rules = [
        (
            Scores {
                window: Some(3),
                ..causal
            },
            true,
        ),
        (
            Scores {
                window: Some(0),
                ..causal
            },
            false,
        ),
        (
            Scores {
                softcap: Some(0.0),
                ..causal
            },
            false,
        ),
        (
            Scores {
                softcap: Some(-1.0),
                ..causal
            },
            false,
        ),
        (
            Scores {
                scale: f32::NAN,
                ..causal
            },
            false,
        ),
    ];
    for (rule, fine) in rules {
        let case = PagedCase::new(&mut r, 4, &[3]).scored(rule);
        let result = case.attention(&mut backend(), &k, &k, &[(0, 2)], &q, shape);
        assert_eq!(result.is_ok(), fine, "{rule:?}: {result:?}");
    }
}

#[test]
fn argmax_takes_the_first_of_equal_maxima_in_each_row() {
    let mut b = backend();
    let x = upload(&mut b, &[1.0, 3.0, 3.0, -1.0, -5.0, -2.0, -2.0, -9.0]);
    let out = upload_u32(&mut b, &[u32::MAX; 2]);
    b.argmax(x, out, 2, 4, None).unwrap();
    let mut got = [0u32; 2];
    b.read_u32(out, &mut got).unwrap();
    assert_eq!(got, [1, 1]);
    // Within a constraint: the largest allowed value; nothing allowed gives 0.
    let allowed = upload_u32(&mut b, &[0b1001, 0]);
    b.argmax(x, out, 2, 4, Some(allowed)).unwrap();
    b.read_u32(out, &mut got).unwrap();
    assert_eq!(got, [0, 0]);
    let allowed = upload_u32(&mut b, &[0b1100, 0b0100]);
    b.argmax(x, out, 2, 4, Some(allowed)).unwrap();
    b.read_u32(out, &mut got).unwrap();
    assert_eq!(got, [2, 2]);
}

#[test]
fn gated_activations_add_scale_and_softcap() {
    let mut r = rng();
    let n = 37;
    let (g, u) = (randn(&mut r, n), randn(&mut r, n));
    let mut b = backend();
    let (gh, uh, out) = (upload(&mut b, &g), upload(&mut b, &u), poisoned(&mut b, n));
    // In f64, from the definitions: SiLU, and PyTorch's `gelu(approximate="tanh")`.
    let silu = |g: f64| g / (1.0 + (-g).exp());
    let gelu = |g: f64| 0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh());
    for (act, f) in [
        (Activation::Silu, &silu as &dyn Fn(f64) -> f64),
        (Activation::GeluTanh, &gelu),
    ] {
        b.glu(gh, uh, out, n, act).unwrap();
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| (f(g as f64) * u as f64) as f32)
            .collect();
        assert_close(&read(&b, out, n), &want, 1e-6, &format!("{act:?}"));
    }
    b.add(gh, uh, n).unwrap();
    let summed: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g + u).collect();
    assert_eq!(read(&b, gh, n), summed);
    b.scale(gh, 2.5, n).unwrap();
    let scaled: Vec<f32> = summed.iter().map(|v| v * 2.5).collect();
    assert_eq!(read(&b, gh, n), scaled);
    b.softcap(gh, 1.5, n).unwrap();
    let capped: Vec<f32> = scaled.iter().map(|&v| (1.5 * (v as f64 / 1.5).tanh()) as f32).collect();
    assert_close(&read(&b, gh, n), &capped, 1e-6, "softcap");
    assert!(read(&b, gh, n).iter().all(|v| v.abs() < 1.5));
    // In-place use of one block as input and output is refused rather than aliased.
    assert!(b.glu(gh, uh, gh, n, Activation::Silu).is_err());
}

#[test]
fn arena_backed_memory() {
    let mut b = CpuBackend::new(1);
    assert!(b.alloc(16).is_err(), "alloc before reserve");
    b.reserve(1 << 12).unwrap();
    let x = b.alloc(100).unwrap();
    assert_eq!(x.offset % 64, 0);
    b.write_f32(x, &[1.0, 2.0, 3.0]).unwrap();
    assert_eq!(read(&b, x, 3), vec![1.0, 2.0, 3.0]);
    assert!(b.alloc(1 << 12).is_err(), "exhaustion is an error");
    b.free(x).unwrap();
    assert!(b.alloc(1 << 12).is_ok(), "freed space is reused");
}

/// What the integer kernels compute exactly: the dequantized weights times activations that went
/// through 8-bit block quantization.
fn quantized_activations(x: &[f32], n_in: usize) -> Vec<f32> {
    let mut act = Q8Activations::default();
    act.resize(1, n_in);
    x.chunks_exact(n_in)
        .flat_map(|row| {
            let (q, d, s) = (&mut act.q, &mut act.d, &mut act.s);
            quantize_row(row, q, d, s);
            (0..n_in).map(|i| q[i] as f32 * d[i / 4]).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn fast_matmul_every_type_and_instruction_set_matches_the_reference() {
    let mut r = rng();
    for isa in Isa::available() {
        for ty in GgmlType::ALL.into_iter().chain([GgmlType::Fp8]) {
            // Half-chunk rows for the 32-blocks; rows not a multiple of the four-row tile; token
            // counts that leave every remainder of the three-token tile.
            let n_in = if ty.block_len() == 256 { 512 } else { 96 };
            let n_out = 37;
            let bytes = random_weight_bytes(&mut r, ty, n_in * n_out);
            let mut dense = vec![0f32; n_in * n_out];
            dequantize(ty, &bytes, &mut dense);
            for n_tokens in [1, 2, 5, 35] {
                let mut b = CpuBackend::with_kernels(3, CpuKernels::Fast(isa));
                b.reserve(16 << 20).unwrap();
                let w = b
                    .upload_weight(&HostTensor {
                        name: "w",
                        ty,
                        dims: &[n_in, n_out],
                        bytes: &bytes,
                        region: None,
                    })
                    .unwrap();
                let x = randn(&mut r, n_tokens * n_in);
                let (xh, out) = (upload(&mut b, &x), poisoned(&mut b, n_tokens * n_out));
                b.matmul(xh, &w, out, n_tokens).unwrap();
                let xs = if has_int8_kernel(ty) {
                    quantized_activations(&x, n_in)
                } else {
                    x.clone()
                };
                let want: Vec<f32> = (0..n_tokens * n_out)
                    .map(|i| {
                        let (t, o) = (i / n_out, i % n_out);
                        (0..n_in)
                            .map(|k| xs[t * n_in + k] as f64 * dense[o * n_in + k] as f64)
                            .sum::<f64>() as f32
                    })
                    .collect();
                let what = format!("{isa:?} {ty} x {n_tokens} tokens");
                assert_close(&read(&b, out, n_tokens * n_out), &want, 2e-4, &what);
            }
        }
    }
}

#[test]
fn activation_quantization_is_blockwise_and_padded() {
    let x: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) / 7.0).collect();
    let mut act = Q8Activations::default();
    act.resize(1, 96);
    assert_eq!(act.n_chunks, 2);
    assert_eq!(act.q.len(), 2 * CHUNK);
    let (q, d, s) = (&mut act.q, &mut act.d, &mut act.s);
    quantize_row(&x, q, d, s);
    for block in 0..3 {
        let amax = x[block * 32..block * 32 + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(d[block * 8], amax / 127.0);
        assert_eq!(
            q[block * 32..block * 32 + 32].iter().map(|v| v.unsigned_abs()).max(),
            Some(127)
        );
    }
    for g in 0..2 * GROUPS_PER_CHUNK {
        let sum: i32 = q[g * 4..g * 4 + 4].iter().map(|&v| v as i32).sum();
        assert_eq!(s[g], d[g] * sum as f32);
    }
    // The padding past 96 values is zero.
    assert!(q[96..].iter().all(|&v| v == 0) && d[24..].iter().all(|&v| v == 0.0));
}

#[test]
fn fast_attention_over_f32_and_f16_caches_matches_the_matrix_form() {
    for isa in Isa::available() {
        for kv_type in [KvType::F32, KvType::F16] {
            let make = || {
                let mut b = CpuBackend::with_kernels(2, CpuKernels::Fast(isa)).with_kv_type(kv_type);
                b.reserve(16 << 20).unwrap();
                assert_eq!(b.kv_type(), kv_type);
                b
            };
            paged_attention_case(make, 1e-5, &format!("{isa:?} {kv_type:?} attention"));
        }
    }
}

#[test]
fn fast_attention_scores_match_the_reference() {
    // The GPU suite's score cases, the fast kernels standing for the backend under test.
    for isa in Isa::available() {
        common::gpu::attention_scores(
            |kv_type| CpuBackend::with_kernels(2, CpuKernels::Fast(isa)).with_kv_type(kv_type),
            |_, _, _| 1e-5,
        );
    }
}

#[test]
fn fast_rope_attention_then_output_projection_matches_the_reference() {
    // The GPU suite's fused steps (RoPE, the cache write, attention, the output projection added
    // to the residual), many sequences decoding together among them. The fast kernels multiply
    // Q4_K rows on int8 activations (about 0.4% a product) and sum f16 cache rows in their own
    // order.
    for isa in Isa::available() {
        common::gpu::rope_attention_then_output_projection(
            |kv_type| CpuBackend::with_kernels(2, CpuKernels::Fast(isa)).with_kv_type(kv_type),
            |ty, kv_type, _, _| match (ty, kv_type) {
                (Some(GgmlType::Q4K), _) => 2e-2,
                (_, KvType::F16) => 1e-4,
                (_, KvType::F32) => 1e-5,
            },
        );
    }
}

#[test]
fn rope_frequency_scaling_follows_transformers() {
    let rope = |scaling| Rope {
        layout: RopeLayout::Halves,
        theta: 500000.0,
        dims: 128,
        scaling,
        scale: 1.0,
    };
    let base = rope(RopeScaling::None).inverse_frequencies();
    assert_eq!(base.len(), 64);
    assert_eq!(base[0], 1.0);
    let linear = rope(RopeScaling::Linear { factor: 4.0 }).inverse_frequencies();
    assert!(linear.iter().zip(&base).all(|(l, b)| (l * 4.0 - b).abs() <= 1e-6 * b));
    // Llama 3.1's: short wavelengths kept, long ones divided by the factor, a blend between.
    let llama3 = rope(RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    })
    .inverse_frequencies();
    let wavelen = |f: f32| 2.0 * std::f32::consts::PI / f;
    for (s, b) in llama3.iter().zip(&base) {
        if wavelen(*b) < 8192.0 / 4.0 {
            assert_eq!(s, b);
        } else if wavelen(*b) > 8192.0 {
            assert!((s * 8.0 - b).abs() <= 1e-6 * b);
        } else {
            assert!(s < b && *s > b / 8.0);
        }
    }
}

/// Awkward mixture sizes: 6 experts of width 64 over rows of 96, two a token.
const EXPERTS: usize = 6;
const EXPERT_DIM: usize = 96;
const EXPERT_WIDTH: usize = 64;
const EXPERTS_PER_TOKEN: usize = 2;

#[test]
fn routing_takes_the_top_k_of_the_softmax() {
    let mut r = rng();
    let n_tokens = 33;
    let mut logits = randn(&mut r, n_tokens * EXPERTS);
    // Ties: a row of equal logits, and one whose top two are equal.
    logits[..EXPERTS].fill(0.25);
    logits[EXPERTS..2 * EXPERTS].copy_from_slice(&[0.1, 0.9, -0.3, 0.9, 0.2, 0.0]);
    for renormalize in [false, true] {
        let mut b = backend();
        let lh = upload(&mut b, &logits);
        let k = EXPERTS_PER_TOKEN;
        let routes = axiom::backend::Routes {
            ids: upload_u32(&mut b, &vec![u32::MAX; n_tokens * k]),
            weights: poisoned(&mut b, n_tokens * k),
            k,
        };
        let routing = axiom::backend::Routing {
            n_experts: EXPERTS,
            k,
            renormalize,
        };
        b.route(lh, routes, n_tokens, routing).unwrap();
        let mut ids = vec![0u32; n_tokens * k];
        b.read_u32(routes.ids, &mut ids).unwrap();
        let weights = read(&b, routes.weights, n_tokens * k);
        for t in 0..n_tokens {
            let row: Vec<f64> = logits[t * EXPERTS..(t + 1) * EXPERTS]
                .iter()
                .map(|&l| l as f64)
                .collect();
            let total: f64 = row.iter().map(|l| l.exp()).sum();
            let probs: Vec<f64> = row.iter().map(|l| l.exp() / total).collect();
            // The k largest, the lower index first among equals.
            let mut chosen: Vec<usize> = Vec::new();
            for _ in 0..k {
                let best = (0..EXPERTS)
                    .filter(|e| !chosen.contains(e))
                    .fold(None, |b: Option<usize>, e| match b {
                        Some(b) if probs[b] >= probs[e] => Some(b),
                        _ => Some(e),
                    })
                    .unwrap();
                chosen.push(best);
            }
            let sum: f64 = chosen.iter().map(|&e| probs[e]).sum();
            let want: Vec<f32> = chosen
                .iter()
                .map(|&e| (if renormalize { probs[e] / sum } else { probs[e] }) as f32)
                .collect();
            let want_ids: Vec<u32> = chosen.iter().map(|&e| e as u32).collect();
            assert_eq!(&ids[t * k..(t + 1) * k], &want_ids[..], "token {t}");
            assert_close(&weights[t * k..(t + 1) * k], &want, 1e-6, &format!("token {t}"));
        }
        assert_eq!(&ids[..4], &[0, 1, 1, 3], "ties go to the lower index");
    }
}

/// A test case of the expert op: the experts' matrices in `ty`, and a step's routes.
struct ExpertCase {
    ty: GgmlType,
    /// Per expert: gate, up, down as stored.
    matrices: Vec<[Vec<u8>; 3]>,
    x: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    residual: Vec<f32>,
    n_tokens: usize,
}

impl ExpertCase {
    fn new(r: &mut ChaCha8Rng, ty: GgmlType, n_tokens: usize) -> ExpertCase {
        let (d, w) = (EXPERT_DIM, EXPERT_WIDTH);
        let matrices = (0..EXPERTS)
            .map(|_| {
                [
                    random_weight_bytes(r, ty, d * w),
                    random_weight_bytes(r, ty, d * w),
                    random_weight_bytes(r, ty, w * d),
                ]
            })
            .collect();
        // Distinct experts per token; with one token most experts run nothing.
        let ids = (0..n_tokens)
            .flat_map(|_| {
                let first = r.random_range(0..EXPERTS as u32);
                [first, (first + r.random_range(1..EXPERTS as u32)) % EXPERTS as u32]
            })
            .collect();
        ExpertCase {
            ty,
            matrices,
            x: randn(r, n_tokens * d),
            ids,
            weights: (0..n_tokens * EXPERTS_PER_TOKEN)
                .map(|_| r.random_range(0.0f32..1.0))
                .collect(),
            residual: randn(r, n_tokens * d),
            n_tokens,
        }
    }

    /// The residual after the expert op on `b`.
    fn run(&self, mut b: CpuBackend) -> axiom::Result<Vec<f32>> {
        b.reserve(16 << 20).unwrap();
        let (d, w, k, n) = (EXPERT_DIM, EXPERT_WIDTH, EXPERTS_PER_TOKEN, self.n_tokens);
        let mut upload_matrix = |which: usize, n_in: usize, n_out: usize| {
            let tensors: Vec<HostTensor> = self
                .matrices
                .iter()
                .map(|m| HostTensor {
                    name: "expert",
                    ty: self.ty,
                    dims: if which == 2 {
                        &[EXPERT_WIDTH, EXPERT_DIM]
                    } else {
                        &[EXPERT_DIM, EXPERT_WIDTH]
                    },
                    bytes: &m[which],
                    region: None,
                })
                .collect();
            assert_eq!(tensors[0].dims, [n_in, n_out]);
            b.upload_experts(&tensors).unwrap()
        };
        let (gate, up, down) = (upload_matrix(0, d, w), upload_matrix(1, d, w), upload_matrix(2, w, d));
        let x = upload(&mut b, &self.x);
        let routes = axiom::backend::Routes {
            ids: upload_u32(&mut b, &self.ids),
            weights: upload(&mut b, &self.weights),
            k,
        };
        let scratch = axiom::backend::ExpertScratch {
            rows: poisoned(&mut b, n * k * d),
            gate: poisoned(&mut b, n * k * w),
            up: poisoned(&mut b, n * k * w),
            hidden: poisoned(&mut b, n * k * w),
            out: poisoned(&mut b, n * k * d),
            groups: poisoned(&mut b, axiom::backend::ExpertScratch::groups_len(EXPERTS, n * k)),
        };
        let residual = upload(&mut b, &self.residual);
        let set = axiom::backend::ExpertSet {
            gate: &gate,
            up: &up,
            down: &down,
            activation: Activation::Silu,
        };
        b.experts(x, set, routes, scratch, residual, n)?;
        Ok(read(&b, residual, n * d))
    }

    /// The formula in f64 on the dequantized matrices.
    fn want(&self) -> Vec<f32> {
        let (d, w, k) = (EXPERT_DIM, EXPERT_WIDTH, EXPERTS_PER_TOKEN);
        let dense: Vec<[Vec<f32>; 3]> = self
            .matrices
            .iter()
            .map(|m| {
                m.clone().map(|bytes| {
                    let mut v = vec![0f32; d * w];
                    dequantize(self.ty, &bytes, &mut v);
                    v
                })
            })
            .collect();
        let product = |m: &[f32], x: &[f64], n_out: usize| -> Vec<f64> {
            let n_in = x.len();
            (0..n_out)
                .map(|o| (0..n_in).map(|i| m[o * n_in + i] as f64 * x[i]).sum())
                .collect()
        };
        let mut out: Vec<f64> = self.residual.iter().map(|&v| v as f64).collect();
        for t in 0..self.n_tokens {
            let xt: Vec<f64> = self.x[t * d..(t + 1) * d].iter().map(|&v| v as f64).collect();
            for j in 0..k {
                let [g, u, down] = &dense[self.ids[t * k + j] as usize];
                let (g, u) = (product(g, &xt, w), product(u, &xt, w));
                let h: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                for (o, v) in out[t * d..(t + 1) * d].iter_mut().zip(product(down, &h, d)) {
                    *o += self.weights[t * k + j] as f64 * v;
                }
            }
        }
        out.iter().map(|&v| v as f32).collect()
    }
}

/// `|got - want| / |want - residual|`: the error relative to what the experts added.
fn experts_error(case: &ExpertCase, got: &[f32], want: &[f32]) -> f64 {
    let (mut err, mut norm) = (0f64, 0f64);
    for ((g, w), r) in got.iter().zip(want).zip(&case.residual) {
        err += ((g - w) as f64).powi(2);
        norm += ((w - r) as f64).powi(2);
    }
    (err / norm).sqrt()
}

#[test]
fn experts_add_each_tokens_chosen_feed_forward_blocks_weighed() {
    let mut r = rng();
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        for n_tokens in [1, 7, 33] {
            let case = ExpertCase::new(&mut r, ty, n_tokens);
            let err = experts_error(&case, &case.run(CpuBackend::reference(3)).unwrap(), &case.want());
            assert!(err < 1e-5, "{ty} x {n_tokens} tokens: relative error {err}");
        }
    }
}

#[test]
fn fast_experts_grouped_by_expert_match_the_reference() {
    let mut r = rng();
    for isa in Isa::available() {
        for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0] {
            for n_tokens in [1, 7, 33] {
                let case = ExpertCase::new(&mut r, ty, n_tokens);
                let want = case.run(CpuBackend::reference(3)).unwrap();
                let got = case.run(CpuBackend::with_kernels(3, CpuKernels::Fast(isa))).unwrap();
                // The integer kernels quantize the activations to 8 bits on the way in.
                let bound = if has_int8_kernel(ty) { 2e-2 } else { 1e-5 };
                let err = experts_error(&case, &got, &want);
                assert!(err < bound, "{isa:?} {ty} x {n_tokens} tokens: relative error {err}");
            }
        }
    }
}

#[test]
fn fast_expert_ops_match_the_reference() {
    // The GPU suite's expert cases (Q8_0, and Q4_K with Q6_K down), the fast kernels standing for
    // the backend under test; they quantize the activations to 8 bits on the way in.
    for isa in Isa::available() {
        common::gpu::expert_ops(|| CpuBackend::with_kernels(2, CpuKernels::Fast(isa)), 2e-2);
    }
}

#[test]
fn fast_mixture_blocks_match_the_reference() {
    for isa in Isa::available() {
        common::gpu::mixture_blocks(|| CpuBackend::with_kernels(2, CpuKernels::Fast(isa)), 2e-2);
    }
}

#[test]
fn experts_refuse_an_expert_outside_the_set() {
    let mut r = rng();
    let mut case = ExpertCase::new(&mut r, GgmlType::F32, 7);
    case.ids[5] = EXPERTS as u32;
    for kernels in [CpuKernels::Reference, CpuKernels::Fast(Isa::detect())] {
        let err = case.run(CpuBackend::with_kernels(1, kernels)).unwrap_err().to_string();
        assert!(err.contains("expert 6 chosen of 6 experts"), "{kernels:?}: {err}");
    }
}

#[test]
fn add_gated_scales_rows_by_the_sigmoid_of_their_gate() {
    let mut r = rng();
    let (n_tokens, width) = (7, 96);
    let (x, rows, gates) = (
        randn(&mut r, n_tokens * width),
        randn(&mut r, n_tokens * width),
        randn(&mut r, n_tokens),
    );
    let mut b = backend();
    let (xh, rh, gh) = (upload(&mut b, &x), upload(&mut b, &rows), upload(&mut b, &gates));
    b.add_gated(xh, rh, gh, n_tokens, width).unwrap();
    let want: Vec<f32> = (0..n_tokens * width)
        .map(|i| x[i] + rows[i] / (1.0 + (-gates[i / width]).exp()))
        .collect();
    assert_close(&read(&b, xh, n_tokens * width), &want, 1e-6, "add_gated");
}
