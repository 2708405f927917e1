//! The checks every GPU backend must pass against the CPU reference and against Hugging Face
//! transformers, written once over [`Backend`] (tests/cuda.rs and tests/metal.rs run them).
//! Outputs are poisoned before each run, so an element a kernel never writes fails.

use super::{capped_window, paged_queries, random_weight_bytes, score_rules, PagedCase, PAGED_LENS};
use axiom::backend::cpu::kernels::argmax::argmax;
use axiom::backend::cpu::CpuBackend;
use axiom::backend::{
    Activation, AttentionKv, AttentionShape, Backend, BlockHandle, ExpertScratch, ExpertSet, FeedForward,
    FeedForwardScratch, GluRows, HostTensor, Input, Kernels, KvType, Mixture, MixtureScratch, NewRows, NextInput,
    PagedKv, Projection, Residual, Rope, RopeLayout, RopeScaling, Routes, Routing, Scores, StepLayout,
    GPU_WEIGHT_TYPES,
};
use axiom::chat::Message;
use axiom::convert::convert_hf_dir;
use axiom::engine::perplexity::perplexity;
use axiom::engine::Session;
use axiom::format::fp8;
use axiom::format::quant::GgmlType;
use axiom::model::llama::LoadOptions;
use axiom::model::{GreedyDecode, LogitRows};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `v` as a KV cache of `kv_type` holds it.
fn as_cached(v: Vec<f32>, kv_type: KvType) -> Vec<f32> {
    match kv_type {
        KvType::F16 => v.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        KvType::F32 => v,
    }
}

/// Random key and value rows (all the keys drawn first) for sequences of `lens` tokens, as a
/// cache of `kv_type` holds them.
fn cached_kv(rng: &mut ChaCha8Rng, lens: &[usize], kv_width: usize, kv_type: KvType) -> [Vec<Vec<f32>>; 2] {
    let mut rows = || -> Vec<Vec<f32>> {
        lens.iter()
            .map(|l| as_cached(randn(rng, l * kv_width), kv_type))
            .collect()
    };
    [rows(), rows()]
}

/// The backend under test (`make()`, arena reserved) and the CPU reference.
fn pair<B: Backend>(make: impl Fn() -> B) -> (B, CpuBackend) {
    let mut gpu = make();
    gpu.reserve(256 << 20).unwrap();
    let mut cpu = CpuBackend::reference(4);
    cpu.reserve(256 << 20).unwrap();
    (gpu, cpu)
}

fn put<B: Backend>(b: &mut B, data: &[f32]) -> BlockHandle {
    let h = b.alloc(data.len() * 4).unwrap();
    b.write_f32(h, data).unwrap();
    h
}

fn put_u32<B: Backend>(b: &mut B, data: &[u32]) -> BlockHandle {
    let h = b.alloc(data.len() * 4).unwrap();
    b.write_u32(h, data).unwrap();
    h
}

/// An output block poisoned with NaN, so an element the kernel never writes fails the check.
fn poisoned<B: Backend>(b: &mut B, n: usize) -> BlockHandle {
    put(b, &vec![f32::NAN; n])
}

fn get<B: Backend>(b: &B, h: BlockHandle, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    b.read_f32(h, &mut out).unwrap();
    out
}

#[track_caller]
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "non-finite output (an element was not written?)"
    );
    let err: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (err / norm.max(1e-30)).sqrt()
}

/// A random `[n_out, n_in]` weight of type `ty`, uploaded to the backend under test and the CPU.
fn random_weight<B: Backend>(
    rng: &mut ChaCha8Rng,
    gpu: &mut B,
    cpu: &mut CpuBackend,
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
) -> (B::Weight, <CpuBackend as Kernels>::Weight) {
    let bytes = random_weight_bytes(rng, ty, n_in * n_out);
    upload_pair(gpu, cpu, ty, [n_in, n_out], &bytes)
}

/// A `[n_out, n_in]` weight of type `ty` stored as `bytes`, uploaded to both backends.
fn upload_pair<B: Backend>(
    gpu: &mut B,
    cpu: &mut CpuBackend,
    ty: GgmlType,
    dims: [usize; 2],
    bytes: &[u8],
) -> (B::Weight, <CpuBackend as Kernels>::Weight) {
    let tensor = HostTensor {
        name: "w",
        ty,
        dims: &dims,
        bytes,
        region: None,
    };
    (gpu.upload_weight(&tensor).unwrap(), cpu.upload_weight(&tensor).unwrap())
}

/// What each scale of a random FP8 weight covers. Checkpoints' scales cover square blocks (128
/// wide as published, 64 or 32 for models narrower than whole 128s), a row or the whole matrix,
/// and a backend may keep each once (`random_weight_bytes` gives every 32-value block a scale of
/// its own).
#[derive(Clone, Copy, Debug)]
enum Fp8Grain {
    Matrix,
    Blocks(usize),
    Row,
}

impl Fp8Grain {
    /// What published checkpoints have: a scale a matrix, a 128 x 128 block or a row.
    const PUBLISHED: [Fp8Grain; 3] = [Fp8Grain::Matrix, Fp8Grain::Blocks(128), Fp8Grain::Row];
    const ALL: [Fp8Grain; 5] = [
        Fp8Grain::Matrix,
        Fp8Grain::Blocks(128),
        Fp8Grain::Blocks(64),
        Fp8Grain::Blocks(32),
        Fp8Grain::Row,
    ];
}

/// A random `[n_out, n_in]` FP8 weight with scales (1e-4 to 1e-2) over `grain`, and codes other
/// than the two NaNs.
fn fp8_weight_bytes(rng: &mut ChaCha8Rng, [n_in, n_out]: [usize; 2], grain: Fp8Grain) -> Vec<u8> {
    let codes: Vec<u8> = (0..n_in * n_out)
        .map(|_| match rng.random::<u8>() {
            c if c & 0x7f == 0x7f => c & 0xfe,
            c => c,
        })
        .collect();
    let n_scales = match grain {
        Fp8Grain::Matrix => 1,
        Fp8Grain::Blocks(n) => fp8::ScaleBlock::square(n).grid(n_out, n_in).iter().product(),
        Fp8Grain::Row => n_out,
    };
    let scales: Vec<f32> = (0..n_scales).map(|_| rng.random_range(1e-4f32..1e-2)).collect();
    let scale = |row: usize, col: usize| match grain {
        Fp8Grain::Matrix => scales[0],
        Fp8Grain::Blocks(n) => scales[fp8::ScaleBlock::square(n).index(row, col, n_in)],
        Fp8Grain::Row => scales[row],
    };
    let mut bytes = vec![0u8; n_in * n_out / fp8::CODES_PER_BLOCK * fp8::BLOCK_BYTES];
    fp8::pack(&codes, n_in, scale, &mut bytes);
    bytes
}

/// `x` under the RMS norm of `weight` (eps 1e-5), as a matmul input.
fn normed(x: BlockHandle, weight: BlockHandle, scratch: BlockHandle) -> Input {
    Input::RmsNormed {
        x,
        weight,
        eps: 1e-5,
        scratch,
    }
}

/// The weight types every GPU backend runs (`GPU_WEIGHT_TYPES`), FP8 blocks among them.
pub fn weight_types() -> Vec<GgmlType> {
    GPU_WEIGHT_TYPES.map(|(ty, _)| ty).to_vec()
}

/// Every weight type of `types` (those the backend runs), short and long rows (backends may
/// switch kernels with the row length), and several token counts; `tolerance(type, n_in,
/// n_tokens)` is the relative error the backend's kernels for that case allow.
pub fn matmul_every_type_and_token_count<B: Backend>(
    make: impl Fn() -> B,
    types: &[GgmlType],
    tolerance: impl Fn(GgmlType, usize, usize) -> f64,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let short = |ty: GgmlType| if ty.block_len() == 256 { 512 } else { 96 };
    // K-quant rows of 4352 (17 super-blocks) also: longer than the 4096 values a CUDA Q4_K warp
    // stages at once, and ending in a half tile of its interleaved layout.
    let long = |ty: GgmlType| {
        if ty.block_len() == 256 {
            &[2048, 4352][..]
        } else {
            &[2048][..]
        }
    };
    let cases = types.iter().flat_map(|&ty| {
        std::iter::once(short(ty))
            .chain(long(ty).iter().copied())
            .map(move |n| (ty, n))
    });
    for (ty, n_in) in cases {
        let n_out = 37;
        let (mut gpu, mut cpu) = pair(&make);
        let (wg, wc) = random_weight(&mut rng, &mut gpu, &mut cpu, ty, n_in, n_out);
        gpu.prepare(64, n_in).unwrap_or(());
        let norm = randn(&mut rng, n_in);
        let (ng, nc) = (put(&mut gpu, &norm), put(&mut cpu, &norm));
        for n_tokens in [1, 3, 5, 8, 35] {
            let (x, residual) = (randn(&mut rng, n_tokens * n_in), randn(&mut rng, n_tokens * n_out));
            let n = n_tokens * n_out;
            let (xg, xc) = (put(&mut gpu, &x), put(&mut cpu, &x));
            let tol = tolerance(ty, n_in, n_tokens);
            let check = |gpu: &B, cpu: &CpuBackend, what: &str, og, oc| {
                let err = rel_l2(&get(gpu, og, n), &get(cpu, oc, n));
                assert!(
                    err < tol,
                    "{what} {ty} [{n_out}, {n_in}] x {n_tokens} tokens: relative error {err}"
                );
            };
            let (og, oc) = (poisoned(&mut gpu, n), poisoned(&mut cpu, n));
            gpu.matmul(xg, &wg, og, n_tokens).unwrap();
            cpu.matmul(xc, &wc, oc, n_tokens).unwrap();
            check(&gpu, &cpu, "matmul", og, oc);
            // The input RMS-normalized on the way in (a backend may fold the norm into the matmul).
            let (og, oc) = (poisoned(&mut gpu, n), poisoned(&mut cpu, n));
            let (sg, sc) = (poisoned(&mut gpu, x.len()), poisoned(&mut cpu, x.len()));
            gpu.matmul_many(normed(xg, ng, sg), &[&wg], &[og], n_tokens).unwrap();
            cpu.matmul_many(normed(xc, nc, sc), &[&wc], &[oc], n_tokens).unwrap();
            check(&gpu, &cpu, "normed matmul", og, oc);
            // The product added to a residual.
            let (og, oc) = (put(&mut gpu, &residual), put(&mut cpu, &residual));
            let (sg, sc) = (poisoned(&mut gpu, n), poisoned(&mut cpu, n));
            gpu.matmul_add(xg, &wg, residual_in(og, sg), n_tokens).unwrap();
            cpu.matmul_add(xc, &wc, residual_in(oc, sc), n_tokens).unwrap();
            check(&gpu, &cpu, "matmul_add", og, oc);
        }
    }
    // Several weights on one input, as Q/K/V take it: two of one type and one of another (a
    // Q4_K_M file stores V in Q6_K), so a backend that groups them must split by type.
    for n_in in [512, 2048] {
        let (mut gpu, mut cpu) = pair(&make);
        let specs = [(GgmlType::Q4K, 37), (GgmlType::Q4K, 29), (GgmlType::Q6K, 50)];
        let (wg, wc): (Vec<_>, Vec<_>) = specs
            .iter()
            .map(|&(ty, n_out)| random_weight(&mut rng, &mut gpu, &mut cpu, ty, n_in, n_out))
            .unzip();
        gpu.prepare(64, n_in).unwrap();
        for n_tokens in [1, 3, 8] {
            let x = randn(&mut rng, n_tokens * n_in);
            let (xg, xc) = (put(&mut gpu, &x), put(&mut cpu, &x));
            let og: Vec<BlockHandle> = specs.iter().map(|s| poisoned(&mut gpu, n_tokens * s.1)).collect();
            let oc: Vec<BlockHandle> = specs.iter().map(|s| poisoned(&mut cpu, n_tokens * s.1)).collect();
            gpu.matmul_many(xg.into(), &wg.iter().collect::<Vec<_>>(), &og, n_tokens)
                .unwrap();
            cpu.matmul_many(xc.into(), &wc.iter().collect::<Vec<_>>(), &oc, n_tokens)
                .unwrap();
            for (i, &(ty, n_out)) in specs.iter().enumerate() {
                let err = rel_l2(&get(&gpu, og[i], n_tokens * n_out), &get(&cpu, oc[i], n_tokens * n_out));
                let tol = tolerance(ty, n_in, n_tokens);
                assert!(
                    err < tol,
                    "matmul_many #{i} {ty} [{n_out}, {n_in}] x {n_tokens}: relative error {err}"
                );
            }
        }
    }
    // Tall matrices, more rows than a GPU's warps hold at once (the blocks come in several waves,
    // or a persistent kernel walks several rows a warp), in an odd count: products, products
    // added to a residual, and gate and up with their SwiGLU. Q4_K and Q6_K also in rows of 4352,
    // which a CUDA warp stages in three parts, the last a half tile (fewer of them: the arena
    // also holds a 16-bit copy of the largest weight for cuBLAS).
    for (ty, n_in, n_out) in [
        (GgmlType::Q4K, 2048, 24577),
        (GgmlType::Q4K, 4352, 8195),
        (GgmlType::Q6K, 2048, 24577),
        (GgmlType::Q6K, 4352, 8195),
        (GgmlType::Q8_0, 2048, 24577),
    ] {
        let (mut gpu, mut cpu) = pair(&make);
        let (gate, up) = (
            random_weight(&mut rng, &mut gpu, &mut cpu, ty, n_in, n_out),
            random_weight(&mut rng, &mut gpu, &mut cpu, ty, n_in, n_out),
        );
        gpu.prepare(64, n_in).unwrap();
        for n_tokens in [1, 3] {
            let case = format!("tall {ty} [{n_out}, {n_in}] x {n_tokens}");
            let acts = [Activation::Silu, Activation::GeluTanh];
            let tol = tolerance(ty, n_in, n_tokens);
            check_products(
                &mut rng,
                (&mut gpu, &mut cpu),
                (&gate, &up),
                [n_in, n_out],
                n_tokens,
                &acts,
                tol,
                &case,
            );
        }
    }
    // FP8 weights whose scales cover the whole matrix, square blocks or a row (a backend may
    // keep each scale once), in shapes that are not whole blocks: products, products added
    // to a residual, and gate and up with SwiGLU, for every token count the decode kernels take
    // (a step of 7 runs those of 4, 2 and 1) and a prompt's.
    let fp8_cases = [[160, 130], [2080, 257]]
        .into_iter()
        .flat_map(|dims| Fp8Grain::ALL.map(|grain| (dims, grain)));
    for ([n_in, n_out], grain) in fp8_cases.filter(|_| types.contains(&GgmlType::Fp8)) {
        let (mut gpu, mut cpu) = pair(&make);
        let ty = GgmlType::Fp8;
        let gate = upload_pair(
            &mut gpu,
            &mut cpu,
            ty,
            [n_in, n_out],
            &fp8_weight_bytes(&mut rng, [n_in, n_out], grain),
        );
        let up = upload_pair(
            &mut gpu,
            &mut cpu,
            ty,
            [n_in, n_out],
            &fp8_weight_bytes(&mut rng, [n_in, n_out], grain),
        );
        gpu.prepare(64, n_in).unwrap();
        for n_tokens in [1, 2, 3, 4, 5, 7, 8, 35] {
            let case = format!("FP8, a scale per {grain:?}, [{n_out}, {n_in}] x {n_tokens}");
            let tol = tolerance(ty, n_in, n_tokens);
            check_products(
                &mut rng,
                (&mut gpu, &mut cpu),
                (&gate, &up),
                [n_in, n_out],
                n_tokens,
                &[Activation::Silu],
                tol,
                &case,
            );
        }
    }
    // The whole feed-forward block added to a residual, which a backend may fold (the SwiGLU into
    // the gate and up products; the hidden rows kept in 16 bits between the halves), with either
    // gate activation. Short and
    // long rows on either side: a backend may multiply long rows on quantized activations.
    let widths = |ty| {
        [
            (short(ty), short(ty)),
            (2048, short(ty)),
            (short(ty), 2048),
            (2048, 2048),
        ]
    };
    for (ty, (dim, ffn_dim)) in types.iter().flat_map(|&ty| widths(ty).map(|w| (ty, w))) {
        let (mut gpu, mut cpu) = pair(&make);
        let mut weight = |n_in, n_out| random_weight(&mut rng, &mut gpu, &mut cpu, ty, n_in, n_out);
        let (gate, up, down) = (weight(dim, ffn_dim), weight(dim, ffn_dim), weight(ffn_dim, dim));
        gpu.prepare(64, dim.max(ffn_dim)).unwrap();
        let norm = unit_gate_norm(&mut rng, &mut cpu, &gate.1, [dim, ffn_dim]);
        let (ng, nc) = (put(&mut gpu, &norm), put(&mut cpu, &norm));
        let runs = [1, 3, 8, 9, 35]
            .into_iter()
            .flat_map(|n| [Activation::Silu, Activation::GeluTanh].map(|act| (n, act)));
        for (n_tokens, activation) in runs {
            let (x, residual) = (randn(&mut rng, n_tokens * dim), randn(&mut rng, n_tokens * dim));
            let (xg, xc) = (put(&mut gpu, &x), put(&mut cpu, &x));
            let (og, oc) = (put(&mut gpu, &residual), put(&mut cpu, &residual));
            let (sg, sc) = (poisoned(&mut gpu, x.len()), poisoned(&mut cpu, x.len()));
            let hidden = n_tokens * ffn_dim;
            let scratch = |b: &mut dyn FnMut(usize) -> BlockHandle| FeedForwardScratch {
                gate: b(hidden),
                up: b(hidden),
                hidden: b(hidden),
                proj: b(x.len()),
            };
            let scratch_gpu = scratch(&mut |n| poisoned(&mut gpu, n));
            let scratch_cpu = scratch(&mut |n| poisoned(&mut cpu, n));
            let (ffn_gpu, ffn_cpu) = feed_forwards::<B>([&gate, &up, &down], activation);
            // Normalized on the way in, as the model's feed-forward block takes it.
            gpu.feed_forward(normed(xg, ng, sg), ffn_gpu, scratch_gpu, og, n_tokens)
                .unwrap();
            cpu.feed_forward(normed(xc, nc, sc), ffn_cpu, scratch_cpu, oc, n_tokens)
                .unwrap();
            // The block's own output, without the residual it was added to.
            let block = |out: Vec<f32>| -> Vec<f32> { out.iter().zip(&residual).map(|(o, r)| o - r).collect() };
            let got = block(get(&gpu, og, x.len()));
            let bad = got.iter().position(|v| !v.is_finite());
            assert!(
                bad.is_none(),
                "feed_forward {ty} dim {dim}, hidden {ffn_dim} x {n_tokens} tokens, {activation:?}: value {bad:?} is not finite"
            );
            let err = rel_l2(&got, &block(get(&cpu, oc, x.len())));
            // Three products, two of them multiplied: their errors add.
            let tol = 3.0 * tolerance(ty, dim.max(ffn_dim), n_tokens);
            assert!(
                err < tol,
                "feed_forward {ty} dim {dim}, hidden {ffn_dim} x {n_tokens} tokens, {activation:?}: relative error {err}"
            );
        }
    }
}

/// An RMS norm weight for the input of `gate` (`[dim, ffn_dim]`) under which its products are
/// about 1, as in a real model: a backend may hold the hidden values in f16, and the random
/// weights' scales range from 0.1 (f16) to 400 (Q6_K), whose products would leave f16's range or
/// sink below its normal numbers.
fn unit_gate_norm(
    rng: &mut ChaCha8Rng,
    cpu: &mut CpuBackend,
    gate: &<CpuBackend as Kernels>::Weight,
    [dim, ffn_dim]: [usize; 2],
) -> Vec<f32> {
    let norm = randn(rng, dim);
    let (probe, probe_out) = (put(cpu, &randn(rng, dim)), poisoned(cpu, ffn_dim));
    let nc = put(cpu, &norm);
    let sc = poisoned(cpu, dim);
    cpu.matmul_many(normed(probe, nc, sc), &[gate], &[probe_out], 1)
        .unwrap();
    let products = get(cpu, probe_out, ffn_dim);
    let gate_rms = (products.iter().map(|v| v * v).sum::<f32>() / ffn_dim as f32).sqrt();
    norm.iter().map(|v| v / gate_rms).collect()
}

/// FP8 weights as checkpoints have them (rows of whole 128-value groups; a scale over the whole
/// matrix, each 128 x 128 block or each row) by prompts of awkward lengths: the product, the
/// product of normalized rows, the product added to a residual, and the feed-forward block
/// (gate and up of `[n_in, n_out]`, down back), against the CPU. Outputs have room for the step
/// padded to a multiple of 4 tokens, as a model's scratch (sized for its longest step) has: a
/// backend may write the padding. Returns each case with its relative error for the backend's
/// test to bound (the feed-forward cases' names start with "feed_forward"); `check_weight` sees
/// each weight as uploaded.
pub fn fp8_prompt_products<B: Backend>(
    make: impl Fn() -> B,
    check_weight: impl Fn(&B, &B::Weight),
) -> Vec<(String, f64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut errors = Vec::new();
    let shapes = [[384, 640], [1280, 384]]
        .into_iter()
        .flat_map(|dims| Fp8Grain::PUBLISHED.map(|grain| (dims, grain)));
    for ([n_in, n_out], grain) in shapes {
        let (mut gpu, mut cpu) = pair(&make);
        let mut weight = |dims: [usize; 2]| {
            let bytes = fp8_weight_bytes(&mut rng, dims, grain);
            upload_pair(&mut gpu, &mut cpu, GgmlType::Fp8, dims, &bytes)
        };
        let (gate, up, down) = (weight([n_in, n_out]), weight([n_in, n_out]), weight([n_out, n_in]));
        for w in [&gate, &up, &down] {
            check_weight(&gpu, &w.0);
        }
        gpu.prepare(2048, n_in.max(n_out)).unwrap();
        let norm = unit_gate_norm(&mut rng, &mut cpu, &gate.1, [n_in, n_out]);
        let (ng, nc) = (put(&mut gpu, &norm), put(&mut cpu, &norm));
        for n_tokens in [17usize, 300, 2048] {
            let case = format!("FP8, a scale per {grain:?}, [{n_out}, {n_in}] x {n_tokens}");
            let padded = n_tokens.next_multiple_of(4);
            let (n, n_x) = (n_tokens * n_out, n_tokens * n_in);
            let x = randn(&mut rng, n_x);
            let (xg, xc) = (put(&mut gpu, &x), put(&mut cpu, &x));
            let (sg, sc) = (poisoned(&mut gpu, padded * n_in), poisoned(&mut cpu, n_x));
            let (og, oc) = (poisoned(&mut gpu, padded * n_out), poisoned(&mut cpu, n));
            gpu.matmul(xg, &gate.0, og, n_tokens).unwrap();
            cpu.matmul(xc, &gate.1, oc, n_tokens).unwrap();
            errors.push((format!("matmul {case}"), rel_l2(&get(&gpu, og, n), &get(&cpu, oc, n))));
            let (og, oc) = (poisoned(&mut gpu, padded * n_out), poisoned(&mut cpu, n));
            gpu.matmul_many(normed(xg, ng, sg), &[&gate.0], &[og], n_tokens)
                .unwrap();
            cpu.matmul_many(normed(xc, nc, sc), &[&gate.1], &[oc], n_tokens)
                .unwrap();
            let err = rel_l2(&get(&gpu, og, n), &get(&cpu, oc, n));
            errors.push((format!("normed matmul {case}"), err));
            // What a block added, without the residual it was added to.
            let added = |out: Vec<f32>, residual: &[f32]| -> Vec<f32> {
                out.iter().zip(residual).map(|(o, r)| o - r).collect()
            };
            let residual = randn(&mut rng, padded * n_out);
            let (og, oc) = (put(&mut gpu, &residual), put(&mut cpu, &residual[..n]));
            let (rg, rc) = (poisoned(&mut gpu, padded * n_out), poisoned(&mut cpu, n));
            gpu.matmul_add(xg, &up.0, residual_in(og, rg), n_tokens).unwrap();
            cpu.matmul_add(xc, &up.1, residual_in(oc, rc), n_tokens).unwrap();
            let (got, want) = (added(get(&gpu, og, n), &residual), added(get(&cpu, oc, n), &residual));
            errors.push((format!("matmul_add {case}"), rel_l2(&got, &want)));
            let residual = randn(&mut rng, padded * n_in);
            let (og, oc) = (put(&mut gpu, &residual), put(&mut cpu, &residual[..n_x]));
            let scratch = |b: &mut dyn FnMut(usize) -> BlockHandle, tokens: usize| FeedForwardScratch {
                gate: b(tokens * n_out),
                up: b(tokens * n_out),
                hidden: b(tokens * n_out),
                proj: b(tokens * n_in),
            };
            let scratch_gpu = scratch(&mut |len| poisoned(&mut gpu, len), padded);
            let scratch_cpu = scratch(&mut |len| poisoned(&mut cpu, len), n_tokens);
            let activation = Activation::Silu;
            let (ffn_gpu, ffn_cpu) = feed_forwards::<B>([&gate, &up, &down], activation);
            gpu.feed_forward(normed(xg, ng, sg), ffn_gpu, scratch_gpu, og, n_tokens)
                .unwrap();
            cpu.feed_forward(normed(xc, nc, sc), ffn_cpu, scratch_cpu, oc, n_tokens)
                .unwrap();
            let (got, want) = (
                added(get(&gpu, og, n_x), &residual),
                added(get(&cpu, oc, n_x), &residual),
            );
            errors.push((format!("feed_forward {case}"), rel_l2(&got, &want)));
        }
    }
    errors
}

/// Embedding from every type of `types` (those the backend runs), RMSNorm, RoPE in both layouts,
/// both gated activations, add, scale, soft cap and argmax.
pub fn embed_rms_norm_rope_glu_add_scale_softcap_argmax<B: Backend>(make: impl Fn() -> B, types: &[GgmlType]) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for &ty in types {
        let (dim, vocab) = (256, 11);
        let (mut gpu, mut cpu) = pair(&make);
        let (tg, tc) = random_weight(&mut rng, &mut gpu, &mut cpu, ty, dim, vocab);
        let ids = [3u32, 0, 10, 3, 7];
        let (ig, og) = (put_u32(&mut gpu, &ids), poisoned(&mut gpu, ids.len() * dim));
        let (ic, oc) = (put_u32(&mut cpu, &ids), poisoned(&mut cpu, ids.len() * dim));
        gpu.embed(&tg, ig, og, ids.len()).unwrap();
        cpu.embed(&tc, ic, oc, ids.len()).unwrap();
        assert_eq!(
            get(&gpu, og, ids.len() * dim),
            get(&cpu, oc, ids.len() * dim),
            "embed {ty}"
        );
    }

    let (mut gpu, mut cpu) = pair(&make);
    // Rows narrower than a warp's multiple, and rows longer than a block's threads.
    for (n, dim) in [(7, 48), (3, 4100)] {
        rms_norm_rows(&mut rng, &mut gpu, &mut cpu, n, dim);
    }

    // Every dimension rotated, or part of them with an attention factor on cosine and sine.
    for (layout, dims, scale) in [
        (RopeLayout::Adjacent, 48, 1.0),
        (RopeLayout::Halves, 48, 1.0),
        (RopeLayout::Halves, 36, 1.3),
        (RopeLayout::Adjacent, 20, 0.8),
    ] {
        let (heads, hd) = (9, 48);
        let positions = [0u32, 1, 17, 34, 1000];
        let x = randn(&mut rng, positions.len() * heads * hd);
        let rope = Rope {
            layout,
            theta: 10000.0,
            dims,
            scaling: RopeScaling::None,
            scale,
        };
        let (xg, pg) = (put(&mut gpu, &x), put_u32(&mut gpu, &positions));
        let (xc, pc) = (put(&mut cpu, &x), put_u32(&mut cpu, &positions));
        let (fg, fc) = (
            put(&mut gpu, &rope.inverse_frequencies()),
            put(&mut cpu, &rope.inverse_frequencies()),
        );
        gpu.rope(xg, pg, fg, positions.len(), heads, hd, rope).unwrap();
        cpu.rope(xc, pc, fc, positions.len(), heads, hd, rope).unwrap();
        assert!(
            rel_l2(&get(&gpu, xg, x.len()), &get(&cpu, xc, x.len())) < 1e-6,
            "rope {layout:?}, {dims} dims, scale {scale}"
        );
    }

    let n = 1001;
    let (a, b) = (randn(&mut rng, n), randn(&mut rng, n));
    let (ag, bg, og) = (put(&mut gpu, &a), put(&mut gpu, &b), poisoned(&mut gpu, n));
    let (ac, bc, oc) = (put(&mut cpu, &a), put(&mut cpu, &b), poisoned(&mut cpu, n));
    for act in [Activation::Silu, Activation::GeluTanh] {
        gpu.glu(ag, bg, og, n, act).unwrap();
        cpu.glu(ac, bc, oc, n, act).unwrap();
        assert!(rel_l2(&get(&gpu, og, n), &get(&cpu, oc, n)) < 1e-6, "{act:?}");
    }
    gpu.add(ag, bg, n).unwrap();
    cpu.add(ac, bc, n).unwrap();
    assert!(rel_l2(&get(&gpu, ag, n), &get(&cpu, ac, n)) < 1e-7, "add");
    gpu.scale(ag, 2.5, n).unwrap();
    cpu.scale(ac, 2.5, n).unwrap();
    assert!(rel_l2(&get(&gpu, ag, n), &get(&cpu, ac, n)) < 1e-7, "scale");
    // A cap below most of the values (up to 5 after the add and the scale).
    gpu.softcap(ag, 1.5, n).unwrap();
    cpu.softcap(ac, 1.5, n).unwrap();
    assert!(rel_l2(&get(&gpu, ag, n), &get(&cpu, ac, n)) < 1e-6, "softcap");

    // Argmax of rows wider than a block, with a tie placed so the lower index must win, and a
    // row of NaN, which must still give a token id (the next greedy step embeds it unchecked).
    let (rows, width) = (4, 49_157);
    let mut x = randn(&mut rng, rows * width);
    x[width + 100] = 5.0;
    x[width + 40_000] = 5.0;
    x[3 * width..].fill(f32::NAN);
    let (xg, xc) = (put(&mut gpu, &x), put(&mut cpu, &x));
    let (og, oc) = (put_u32(&mut gpu, &[u32::MAX; 4]), put_u32(&mut cpu, &[u32::MAX; 4]));
    gpu.argmax(xg, og, rows, width, None).unwrap();
    cpu.argmax(xc, oc, rows, width, None).unwrap();
    let (mut got, mut want) = ([0u32; 4], [0u32; 4]);
    gpu.read_u32(og, &mut got).unwrap();
    cpu.read_u32(oc, &mut want).unwrap();
    assert_eq!(got, want, "argmax");
    assert_eq!((want[1], want[3]), (100, 0));

    // Within a constraint's bits: a quarter of the values allowed (the tie's lower index not
    // among them), nothing allowed in row 2 (index 0), one value in row 3's NaN.
    let words = width.div_ceil(32);
    let mut allowed: Vec<u32> = (0..rows * words)
        .map(|_| rng.random::<u32>() & rng.random::<u32>())
        .collect();
    allowed[words + 100 / 32] &= !(1 << (100 % 32));
    allowed[words + 40_000 / 32] |= 1 << (40_000 % 32);
    allowed[2 * words..].fill(0);
    allowed[3 * words + 5] = 1;
    let (ag, ac) = (put_u32(&mut gpu, &allowed), put_u32(&mut cpu, &allowed));
    gpu.argmax(xg, og, rows, width, Some(ag)).unwrap();
    cpu.argmax(xc, oc, rows, width, Some(ac)).unwrap();
    gpu.read_u32(og, &mut got).unwrap();
    cpu.read_u32(oc, &mut want).unwrap();
    assert_eq!(got, want, "argmax within a constraint");
    assert_eq!((want[1], want[2]), (40_000, 0));
    gpu.argmax(xg, og, rows, width, None).unwrap();
    cpu.argmax(xc, oc, rows, width, None).unwrap();
    cpu.read_u32(oc, &mut want).unwrap();

    // Queued argmaxes of rows 1 and 3 (the index and the next position written to the device
    // too, the second's position over the one it follows), waited for in either order, and
    // again over work queued since.
    let row = |r: usize| xg.slice(r * width * 4, width * 4);
    let positions = put_u32(&mut gpu, &[10, 20, 30, 40]);
    let at = |i: usize| positions.slice(i * 4, 4);
    let slots = [gpu.choice_slot().unwrap(), gpu.choice_slot().unwrap()];
    let queued = [(1, og.slice(0, 4), at(1), at(0)), (3, og.slice(4, 4), at(2), at(2))];
    for (slot, (r, token, chosen_at, position)) in slots.iter().zip(queued) {
        let next = NextInput {
            token,
            chosen_at,
            position,
        };
        gpu.queue_argmax(row(r), next, width, slot).unwrap();
        gpu.mark_choice(slot).unwrap();
    }
    gpu.argmax(xg, og.slice(8, 8), 2, width, None).unwrap();
    assert_eq!(gpu.wait_choice(&slots[1]).unwrap(), want[3], "queued argmax");
    assert_eq!(gpu.wait_choice(&slots[0]).unwrap(), want[1], "queued argmax");
    gpu.read_u32(og, &mut got).unwrap();
    assert_eq!(got, [want[1], want[3], want[0], want[1]], "queued argmax on the device");
    gpu.read_u32(positions, &mut got).unwrap();
    assert_eq!(got, [21, 20, 31, 40], "queued argmax's next positions");
}

/// `rms_norm` on `n` random rows of `dim`.
fn rms_norm_rows<B: Backend>(rng: &mut ChaCha8Rng, gpu: &mut B, cpu: &mut CpuBackend, n: usize, dim: usize) {
    let x = randn(rng, n * dim);
    let w = randn(rng, dim);
    let (xg, wg, og) = (put(gpu, &x), put(gpu, &w), poisoned(gpu, n * dim));
    let (xc, wc, oc) = (put(cpu, &x), put(cpu, &w), poisoned(cpu, n * dim));
    gpu.rms_norm(xg, wg, og, n, dim, 1e-5).unwrap();
    cpu.rms_norm(xc, wc, oc, n, dim, 1e-5).unwrap();
    assert!(
        rel_l2(&get(gpu, og, n * dim), &get(cpu, oc, n * dim)) < 1e-6,
        "rms_norm, rows of {dim}"
    );
}

/// kv_write then attention through scrambled block tables, with f16 and f32 caches: head_dim 48
/// over [`PAGED_LENS`]; head_dim 64 and 128 with a 600-token prefill (several query and key tiles
/// for a tiled kernel) next to decodes; and decodes alone over that context (the path a decode
/// step takes), head_dim 48 and 128, also one at a time, and 256 (the largest the CUDA kernels
/// take). `tolerance(kv_type, head_dim)` is the relative error allowed.
pub fn paged_kv_write_and_attention<B: Backend>(make: impl Fn(KvType) -> B, tolerance: impl Fn(KvType, usize) -> f64) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let long_lens = [600, 20];
    let long_queries: Vec<(u32, u32)> = (0..600).map(|p| (0, p)).chain([(1, 19), (1, 0), (0, 75)]).collect();
    let decodes = vec![(0, 599), (1, 19), (0, 255), (0, 256), (1, 0)];
    let cases = [
        (48, &PAGED_LENS[..], paged_queries()),
        (64, &long_lens[..], long_queries.clone()),
        (128, &long_lens[..], long_queries),
        (48, &long_lens[..], decodes.clone()),
        (128, &long_lens[..], decodes),
        // One token a step, as a single sequence decodes (a GPU may split a long context over
        // several blocks a head).
        (48, &long_lens[..], vec![(1, 19)]),
        (48, &long_lens[..], vec![(0, 300)]),
        (128, &long_lens[..], vec![(0, 599)]),
        (256, &long_lens[..], vec![(0, 599)]),
    ];
    for kv_type in [KvType::F16, KvType::F32] {
        for ((head_dim, lens, queries), page_size) in cases.iter().flat_map(|c| [(c, 4), (c, 16)]) {
            let shape = AttentionShape {
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: *head_dim,
            };
            let case = PagedCase::new(&mut rng, page_size, lens);
            let err = paged_attention_error(&make, kv_type, (&case, lens), queries, shape, &mut rng);
            assert!(
                err < tolerance(kv_type, *head_dim),
                "{kv_type:?} paged attention, head_dim {head_dim}, pages of {page_size}: relative error {err}"
            );
        }
    }
}

/// The relative error of `make(kv_type)`'s paged attention against the CPU reference's, for
/// `queries` (sequence, position) over random keys and values of sequences of `lens` in `case`'s
/// pages. An f16 cache holds rounded K and V: the reference is given the same values.
fn paged_attention_error<B: Backend>(
    make: &impl Fn(KvType) -> B,
    kv_type: KvType,
    (case, lens): (&PagedCase, &[usize]),
    queries: &[(u32, u32)],
    shape: AttentionShape,
    rng: &mut ChaCha8Rng,
) -> f64 {
    let [k, v] = cached_kv(rng, lens, shape.kv_width(), kv_type);
    let q = randn(rng, queries.len() * shape.q_width());
    let (mut gpu, mut cpu) = pair(|| make(kv_type));
    // The larger step: the queries', or the one that writes the cache.
    gpu.prepare(queries.len().max(lens.iter().sum()), 64).unwrap();
    let got = case.attention(&mut gpu, &k, &v, queries, &q, shape).unwrap();
    let want = case.attention(&mut cpu, &k, &v, queries, &q, shape).unwrap();
    rel_l2(&got, &want)
}

/// Attention under each rule of `score_rules` (windows, a soft cap, another scale) against the
/// CPU reference, with f16 and f32 caches over two sequences of 300 and 20 positions: heads of 64
/// and 128 in a step that prefills all of the first sequence (tiles of queries and keys, where a
/// backend has them) next to queries of the second and one mid-way; Gemma 3 270M's 4 heads of
/// 256 over one KV head in the same step; decode steps alone over those contexts; and a single
/// decode. Then many sequences decoding in one step (`many_decodes`), with groups of 3 and of 20
/// query heads a KV head. Pages of 16, and of 4 for the narrowest windows. `tolerance(kv_type,
/// head_dim, n_tokens)` is the relative error allowed.
pub fn attention_scores<B: Backend>(make: impl Fn(KvType) -> B, tolerance: impl Fn(KvType, usize, usize) -> f64) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let lens = vec![300, 20];
    let prefill: Vec<(u32, u32)> = (0..300).map(|p| (0, p)).chain([(1, 19), (1, 0), (0, 75)]).collect();
    let decodes = vec![(0, 299), (1, 19), (0, 150), (1, 0)];
    let single = vec![(0, 299)];
    let (many_lens, many) = many_decodes();
    let steps = [
        (&lens, &prefill),
        (&lens, &decodes),
        (&lens, &single),
        (&many_lens, &many),
    ];
    // (heads, KV heads, head_dim, the steps it runs): 20 heads a KV head only decoding together.
    let shapes = [
        (9, 3, 64, &steps[..]),
        (9, 3, 128, &steps[..]),
        (4, 1, 256, &steps[..]),
        (40, 2, 128, &steps[3..]),
    ];
    for (n_heads, n_kv_heads, head_dim, steps) in shapes {
        let shape = AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        for rule in score_rules(head_dim) {
            let page_size = if rule.window.is_some_and(|w| w < 16) { 4 } else { 16 };
            for (kv_type, (lens, queries)) in [KvType::F16, KvType::F32]
                .into_iter()
                .flat_map(|kv| steps.iter().map(move |&step| (kv, step)))
            {
                let case = PagedCase::new(&mut rng, page_size, lens).scored(rule);
                let err = paged_attention_error(&make, kv_type, (&case, lens), queries, shape, &mut rng);
                assert!(
                    err < tolerance(kv_type, head_dim, queries.len()),
                    "{kv_type:?} attention, {shape:?}, {} tokens, {rule:?}: relative error {err}",
                    queries.len()
                );
            }
        }
    }
}

/// A step of 40 sequences decoding together, as a server's batch does: contexts of 1 to 298
/// positions, each sequence's last position queried, and two sequences queried mid-way too (so
/// that no two of a sequence's tokens are consecutive): every query tile is one token. The
/// sequences' lengths, then the queries.
fn many_decodes() -> (Vec<usize>, Vec<(u32, u32)>) {
    let lens: Vec<usize> = (0..40).map(|s| s * 53 % 298 + 1).collect();
    let mut queries: Vec<(u32, u32)> = (0..40).map(|s| (s as u32, lens[s] as u32 - 1)).collect();
    queries.extend([(1, 26), (2, 53)]);
    (lens, queries)
}

/// `attend_and_project` (attention, then its product with the output projection added to a
/// residual) on decodes over a long context and on a prefill step, for weights a backend may
/// multiply on integers (quantizing the attention's output as it writes it) and for one it does
/// not, with an f16 cache; causal, and with a scale, a soft cap and a window. `tolerance(type,
/// tokens)` is the relative error allowed.
pub fn attention_then_output_projection<B: Backend>(
    make: impl Fn(KvType) -> B,
    tolerance: impl Fn(GgmlType, usize) -> f64,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // Rows of 2048 values, long enough for integer matrix-vector kernels.
    let shape = AttentionShape {
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: 128,
    };
    let (lens, n_out) = ([300, 40], 72);
    // Three queries, as decode steps ask; then a prefill step of 80 tokens over both sequences.
    let steps: [Vec<(u32, u32)>; 2] = [
        vec![(0, 299), (1, 39), (0, 100)],
        (260..300).map(|p| (0, p)).chain((0..40).map(|p| (1, p))).collect(),
    ];
    let causal = Scores::causal(shape.head_dim);
    let runs = [
        (GgmlType::Q8_0, causal),
        (GgmlType::Q4K, causal),
        (GgmlType::BF16, causal),
        (GgmlType::Q4K, capped_window()),
        (GgmlType::BF16, capped_window()),
    ];
    for queries in &steps {
        for (ty, rule) in runs {
            let case = PagedCase::new(&mut rng, 16, &lens).scored(rule);
            let [k, v] = cached_kv(&mut rng, &lens, shape.kv_width(), KvType::F16);
            let q = randn(&mut rng, queries.len() * shape.q_width());
            let residual = randn(&mut rng, queries.len() * n_out);
            let (mut gpu, mut cpu) = pair(|| make(KvType::F16));
            let (wg, wc) = random_weight(&mut rng, &mut gpu, &mut cpu, ty, shape.q_width(), n_out);
            gpu.prepare(128, shape.q_width()).unwrap();
            let inputs = (&case, &k[..], &v[..], &queries[..], &q[..], shape);
            let got = projected(&mut gpu, inputs, &wg, &residual);
            let want = projected(&mut cpu, inputs, &wc, &residual);
            let err = rel_l2(&got, &want);
            assert!(
                err < tolerance(ty, queries.len()),
                "attend_and_project of {} tokens, {ty} output projection, {rule:?}: relative error {err}",
                queries.len()
            );
        }
    }
}

/// A product added to `stream`, held first in `scratch` by a backend that adds in two steps.
/// `gate` and `up` (each on both backends) by `n_tokens` random rows: their products, the
/// products added to a residual, and gate and up with each of `acts`, within `tol` of the CPU
/// (twice that where two products are multiplied); `case` names them in a failure.
#[allow(clippy::too_many_arguments)]
fn check_products<B: Backend>(
    rng: &mut ChaCha8Rng,
    (gpu, cpu): (&mut B, &mut CpuBackend),
    (gate, up): (&WeightPair<B>, &WeightPair<B>),
    [n_in, n_out]: [usize; 2],
    n_tokens: usize,
    acts: &[Activation],
    tol: f64,
    case: &str,
) {
    let n = n_tokens * n_out;
    let x = randn(rng, n_tokens * n_in);
    let (xg, xc) = (put(gpu, &x), put(cpu, &x));
    let check = |gpu: &B, cpu: &CpuBackend, what: &str, og, oc, tol: f64| {
        let err = rel_l2(&get(gpu, og, n), &get(cpu, oc, n));
        assert!(err < tol, "{what} {case}: relative error {err}");
    };
    let (og, oc) = (poisoned(gpu, n), poisoned(cpu, n));
    gpu.matmul(xg, &gate.0, og, n_tokens).unwrap();
    cpu.matmul(xc, &gate.1, oc, n_tokens).unwrap();
    check(gpu, cpu, "matmul", og, oc, tol);
    let residual = randn(rng, n);
    let (og, oc) = (put(gpu, &residual), put(cpu, &residual));
    let (sg, sc) = (poisoned(gpu, n), poisoned(cpu, n));
    gpu.matmul_add(xg, &up.0, residual_in(og, sg), n_tokens).unwrap();
    cpu.matmul_add(xc, &up.1, residual_in(oc, sc), n_tokens).unwrap();
    check(gpu, cpu, "matmul_add", og, oc, tol);
    for &act in acts {
        let rows_g = GluRows {
            gate: poisoned(gpu, n),
            up: poisoned(gpu, n),
            out: poisoned(gpu, n),
        };
        let rows_c = GluRows {
            gate: poisoned(cpu, n),
            up: poisoned(cpu, n),
            out: poisoned(cpu, n),
        };
        gpu.gate_up_glu(xg.into(), [&gate.0, &up.0], rows_g, n_tokens, act)
            .unwrap();
        cpu.gate_up_glu(xc.into(), [&gate.1, &up.1], rows_c, n_tokens, act)
            .unwrap();
        // Two products multiplied: their errors add.
        check(
            gpu,
            cpu,
            &format!("gate_up_glu {act:?}"),
            rows_g.out,
            rows_c.out,
            2.0 * tol,
        );
    }
}

/// A weight uploaded to a backend and to the CPU reference.
type WeightPair<B> = (<B as Kernels>::Weight, <CpuBackend as Kernels>::Weight);

/// The feed-forward block of gate, up and down pairs on the backend and on the CPU reference.
fn feed_forwards<'a, B: Backend>(
    [gate, up, down]: [&'a WeightPair<B>; 3],
    activation: Activation,
) -> (
    FeedForward<'a, B::Weight>,
    FeedForward<'a, <CpuBackend as Kernels>::Weight>,
) {
    let gpu = FeedForward {
        gate: &gate.0,
        up: &up.0,
        down: &down.0,
        activation,
    };
    let cpu = FeedForward {
        gate: &gate.1,
        up: &up.1,
        down: &down.1,
        activation,
    };
    (gpu, cpu)
}

fn residual_in(stream: BlockHandle, scratch: BlockHandle) -> Residual {
    Residual { stream, scratch }
}

/// What `attend_and_project` adds to `residual` for a `PagedCase`'s queries.
type AttentionInputs<'a> = (
    &'a PagedCase,
    &'a [Vec<f32>],
    &'a [Vec<f32>],
    &'a [(u32, u32)],
    &'a [f32],
    AttentionShape,
);
fn projected<B: Backend>(b: &mut B, inputs: AttentionInputs, wo: &B::Weight, residual: &[f32]) -> Vec<f32> {
    let (case, k, v, queries, q, shape) = inputs;
    let sum = case
        .with_cache(b, k, v, queries, q, shape, |b, qh, kv| {
            let (attn, scratch) = (poisoned(b, q.len()), poisoned(b, residual.len()));
            let stream = put(b, residual);
            let proj = Projection {
                wo,
                attn,
                residual: residual_in(stream, scratch),
            };
            b.attend_and_project(qh, kv, proj, queries.len(), shape)?;
            Ok(get(b, stream, residual.len()))
        })
        .unwrap();
    sum.iter().zip(residual).map(|(s, r)| s - r).collect()
}

/// `rope_attend_and_project` (RoPE and the cache write of a step's new rows, then attention and
/// its output projection added to a residual) on steps of one token, which a backend may fold
/// into attention, on a step of three tokens over two sequences and on one of 41 (a prefill's
/// size, where a backend may rotate the queries within attention); then attention of fresh
/// queries at the same positions, which reads back the rows the step stored. Both RoPE layouts,
/// part of each head rotated, f16 and f32 caches; an output projection a backend may multiply on
/// integers (rows of 2048) and an f32 one; heads of 256 with a scale, a soft cap and a window. `tolerance(type, cache, head_dim, tokens)` is the
/// relative error allowed on what the projection of `type` adds, or with `None` on what the
/// attention afterwards reads. The reference's cache is f32: with an f16 one, the rows given are
/// rounded to f16 first, but the rotated keys are rounded only by the backend under test.
pub fn rope_attention_then_output_projection<B: Backend>(
    make: impl Fn(KvType) -> B,
    tolerance: impl Fn(Option<GgmlType>, KvType, usize, usize) -> f64,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let n_out = 72;
    // (heads, KV heads, head_dim, rotated dimensions, output projection's type, factor on cosine
    // and sine, scores); query widths of a multiple of 32, as every backend's weights take.
    let cases = [
        (16, 4, 128, 128, GgmlType::Q4K, 1.13, None),
        (8, 2, 256, 192, GgmlType::Q4K, 0.9, Some(capped_window())),
        (9, 3, 64, 48, GgmlType::F32, 1.0, None),
        (12, 4, 48, 32, GgmlType::F32, 1.27, None),
    ];
    // (sequence, position) of each new token; each sequence holds the rows before its first.
    // Steps over two sequences of 302 and 6 rows, and one of 40 sequences decoding together.
    let prefill: Vec<(u32, u32)> = (261..301).map(|p| (0, p)).chain([(1, 5)]).collect();
    let two: &[usize] = &[302, 6];
    let (many_lens, many) = many_decodes();
    type Step<'a> = (&'a [usize], &'a [(u32, u32)]);
    let steps: [Step; 6] = [
        (two, &[(0, 20)]),
        (two, &[(0, 300)]),
        (two, &[(1, 5)]),
        (two, &[(0, 300), (0, 301), (1, 5)]),
        (two, &prefill),
        (&many_lens, &many[..many_lens.len()]),
    ];
    for (n_heads, n_kv_heads, head_dim, dims, ty, scale, scores) in cases {
        let shape = AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        for (kv_type, layout, (lens, queries)) in [KvType::F16, KvType::F32]
            .into_iter()
            .flat_map(|kv| [RopeLayout::Adjacent, RopeLayout::Halves].map(|l| (kv, l)))
            .flat_map(|(kv, l)| steps.map(|q| (kv, l, q)))
        {
            let rope = Rope {
                layout,
                theta: 10000.0,
                dims,
                scaling: RopeScaling::None,
                scale,
            };
            let case = PagedCase {
                scores,
                ..PagedCase::new(&mut rng, 16, lens)
            };
            // The rows a sequence holds: as many as its first new token's position.
            let held = |s: u32| {
                queries
                    .iter()
                    .filter(|q| q.0 == s)
                    .map(|q| q.1 as usize)
                    .min()
                    .unwrap_or(0)
            };
            let kv_w = shape.kv_width();
            let held: Vec<usize> = (0..lens.len() as u32).map(held).collect();
            let [k, v] = cached_kv(&mut rng, &held, kv_w, kv_type);
            let n = queries.len();
            let mut new: Vec<Vec<f32>> = [shape.q_width(), kv_w, kv_w, shape.q_width()]
                .iter()
                .map(|w| randn(&mut rng, n * w))
                .collect();
            new[2] = as_cached(std::mem::take(&mut new[2]), kv_type);
            let residual = randn(&mut rng, n * n_out);
            let (mut gpu, mut cpu) = pair(|| make(kv_type));
            let (wg, wc) = random_weight(&mut rng, &mut gpu, &mut cpu, ty, shape.q_width(), n_out);
            gpu.prepare(128, shape.q_width()).unwrap();
            let inputs = (&case, &k[..], &v[..], queries, &new[0][..], shape);
            let (added_gpu, read_gpu) = rope_step(&mut gpu, inputs, rope, [&new[1], &new[2], &new[3]], &wg, &residual);
            let (added_cpu, read_cpu) = rope_step(&mut cpu, inputs, rope, [&new[1], &new[2], &new[3]], &wc, &residual);
            let what = format!(
                "{ty} projection, head_dim {head_dim}, {kv_type:?} cache, {layout:?}, scale {scale}, {n} tokens, {scores:?}"
            );
            let err = rel_l2(&added_gpu, &added_cpu);
            assert!(
                err < tolerance(Some(ty), kv_type, head_dim, n),
                "rope_attend_and_project, {what}: relative error {err}"
            );
            let err = rel_l2(&read_gpu, &read_cpu);
            assert!(
                err < tolerance(None, kv_type, head_dim, n),
                "attention over what rope_attend_and_project stored, {what}: relative error {err}"
            );
        }
    }
}

/// What `rope_attend_and_project` adds to `residual` for a `PagedCase`'s queries (the new rows
/// `k`, `v` and, as the case's queries, `q`), and what attention of `q_after` reads afterwards.
fn rope_step<B: Backend>(
    b: &mut B,
    inputs: AttentionInputs,
    rope: Rope,
    [k, v, q_after]: [&[f32]; 3],
    wo: &B::Weight,
    residual: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (case, k_cache, v_cache, queries, q, shape) = inputs;
    let (sum, read) = case
        .with_cache(b, k_cache, v_cache, queries, q, shape, |b, qh, kv| {
            let new = NewRows {
                q: qh,
                k: put(b, k),
                v: put(b, v),
                freqs: put(b, &rope.inverse_frequencies()),
                rope,
            };
            let (attn, scratch) = (poisoned(b, q.len()), poisoned(b, residual.len()));
            let stream = put(b, residual);
            let proj = Projection {
                wo,
                attn,
                residual: residual_in(stream, scratch),
            };
            b.rope_attend_and_project(new, kv, proj, queries.len(), shape)?;
            let (q_after, read) = (put(b, q_after), poisoned(b, q.len()));
            b.attention(q_after, kv, read, queries.len(), shape)?;
            Ok((get(b, stream, residual.len()), get(b, read, q.len())))
        })
        .unwrap();
    (sum.iter().zip(residual).map(|(s, r)| s - r).collect(), read)
}

/// `rope_kv_write` (RoPE on Q and K, then the cache write) over scrambled pages, seen through the
/// rotated queries and through attention over what it stored, in both RoPE layouts.
pub fn rope_kv_write_then_attention<B: Backend>(make: impl Fn(KvType) -> B) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let shape = AttentionShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let len = 21;
    let case = PagedCase::new(&mut rng, 4, &[len]);
    for (layout, dims, scale) in [
        (RopeLayout::Adjacent, 64, 1.0),
        (RopeLayout::Halves, 64, 1.0),
        (RopeLayout::Halves, 48, 1.2),
        (RopeLayout::Adjacent, 64, 0.85),
    ] {
        let rope = Rope {
            layout,
            theta: 10000.0,
            dims,
            scaling: RopeScaling::None,
            scale,
        };
        let q = randn(&mut rng, len * shape.q_width());
        let k = randn(&mut rng, len * shape.kv_width());
        let v = randn(&mut rng, len * shape.kv_width());
        let (mut gpu, mut cpu) = pair(|| make(KvType::F32));
        let (q_gpu, out_gpu) = rope_kv_write_step(&mut gpu, &case, shape, rope, [&q, &k, &v]);
        let (q_cpu, out_cpu) = rope_kv_write_step(&mut cpu, &case, shape, rope, [&q, &k, &v]);
        assert!(
            rel_l2(&q_gpu, &q_cpu) < 1e-6,
            "rope_kv_write {layout:?}, {dims} dims, scale {scale}: rotated queries"
        );
        assert!(
            rel_l2(&out_gpu, &out_cpu) < 1e-5,
            "rope_kv_write {layout:?}, {dims} dims, scale {scale}: attention over the cache"
        );
    }
}

/// One sequence's prefill through `rope_kv_write` then `attention`: the rotated queries and the
/// attention output.
fn rope_kv_write_step<B: Backend>(
    b: &mut B,
    case: &PagedCase,
    shape: AttentionShape,
    rope: Rope,
    [q, k, v]: [&[f32]; 3],
) -> (Vec<f32>, Vec<f32>) {
    let n = q.len() / shape.q_width();
    let cache_values = case.n_pages * case.page_size * shape.kv_width() * b.kv_type().bytes() / 4;
    let (kc, vc) = (poisoned(b, cache_values), poisoned(b, cache_values));
    let (host_positions, host_seqs): (Vec<u32>, Vec<u32>) = ((0..n as u32).collect(), vec![0; n]);
    let pages = PagedKv {
        block_tables: put_u32(b, &case.flat_tables()),
        table_width: case.table_width(),
        token_seqs: put_u32(b, &host_seqs),
        page_size: case.page_size,
    };
    let positions = put_u32(b, &host_positions);
    let freqs = put(b, &rope.inverse_frequencies());
    let (qh, kh, vh, out) = (put(b, q), put(b, k), put(b, v), poisoned(b, q.len()));
    let layout = StepLayout {
        positions: &host_positions,
        token_seqs: &host_seqs,
    };
    let plan = b.plan_step(layout, shape).unwrap();
    let kv = AttentionKv {
        k_cache: kc,
        v_cache: vc,
        positions,
        pages,
        scores: Scores::causal(shape.head_dim),
        plan: &plan,
    };
    let new = NewRows {
        q: qh,
        k: kh,
        v: vh,
        freqs,
        rope,
    };
    b.rope_kv_write(new, kv, n, shape).unwrap();
    b.attention(qh, kv, out, n, shape).unwrap();
    (get(b, qh, q.len()), get(b, out, q.len()))
}

/// SmolLM2's first greedy tokens and its perplexity on the Apache text against transformers.
pub fn smollm2_matches_transformers<B: Backend>(backend: B) {
    let device = backend.device_name();
    let mut s = Session::load(
        &super::smollm2(),
        backend,
        LoadOptions {
            max_batch: 512,
            kv_tokens: 512,
            max_seqs: 1,
        },
    )
    .unwrap();
    let refs = super::read_json("hf_greedy.json");
    for case in refs["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let prompt = match case["kind"].as_str().unwrap() {
            "chat" => s.chat_prompt(&[Message::new("user", text)]).unwrap(),
            _ => s.raw_prompt(text).unwrap(),
        };
        let mut kv = s.model.new_kv_cache(512);
        let logits = s.forward_last(&prompt, &mut kv).unwrap().to_vec();
        s.pages.free(&mut kv);
        let first = argmax(&logits);
        assert_eq!(
            first as u64,
            case["greedy64_ids"][0].as_u64().unwrap(),
            "{}: first token",
            case["name"]
        );
    }
    let text = std::fs::read_to_string(super::refs("apache-2.0.txt")).unwrap();
    let tokens = s.tokenizer.encode(&text, false, false).unwrap();
    let ppl = perplexity(&mut s.model, &mut s.pages, &tokens, 512, None, |_, _, _| {})
        .unwrap()
        .perplexity;
    println!("SmolLM2 perplexity on {device}: {ppl:.4}");
    assert!((ppl / 15.9167 - 1.0).abs() < 0.01, "perplexity {ppl}");
}

/// Random stacks of `n_experts` `[n_out, n_in]` matrices of type `ty`, uploaded as one layer's
/// experts to the backend under test and the CPU.
#[allow(clippy::type_complexity, reason = "the two backends' weights, side by side")]
fn random_experts<B: Backend>(
    rng: &mut ChaCha8Rng,
    gpu: &mut B,
    cpu: &mut CpuBackend,
    ty: GgmlType,
    [n_in, n_out]: [usize; 2],
    n_experts: usize,
) -> (Vec<B::Weight>, Vec<<CpuBackend as Kernels>::Weight>) {
    // FP8 experts' scales cover each a granularity of its own (a backend may keep them compactly,
    // each expert its own way), then a 32-value block.
    let bytes: Vec<Vec<u8>> = (0..n_experts)
        .map(|e| match Fp8Grain::ALL.get(e) {
            Some(&grain) if ty == GgmlType::Fp8 => fp8_weight_bytes(rng, [n_in, n_out], grain),
            _ => random_weight_bytes(rng, ty, n_in * n_out),
        })
        .collect();
    let names: Vec<String> = (0..n_experts).map(|e| format!("expert {e}")).collect();
    let dims = [n_in, n_out];
    let tensors: Vec<HostTensor> = bytes
        .iter()
        .zip(&names)
        .map(|(bytes, name)| HostTensor {
            name,
            ty,
            dims: &dims,
            bytes,
            region: None,
        })
        .collect();
    (
        gpu.upload_experts(&tensors).unwrap(),
        cpu.upload_experts(&tensors).unwrap(),
    )
}

/// The mixture-of-experts ops against the CPU reference, 6 experts of which each of 1, 7 and 33
/// tokens runs 2, in Q8_0 at a width of 96, in Q4_K_M's mix (gate and up Q4_K, down Q6_K), in
/// 16-bit, FP8 and other block types, and with gate and up of two types; and 12 experts of which
/// each token runs 9, in Q4_K:
/// `route` over router logits with exact ties (the same ids), `experts` on each backend's own
/// routes, and `add_gated`.
pub fn expert_ops<B: Backend>(make: impl Fn() -> B, tolerance: f64) {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // (gate, up, down, model width, expert width, experts, picks); gate and up of two types take
    // the backends' unfused path (separate products, then the gated activation); 9 picks are more
    // than a CUDA block's eight warps take at once.
    for (ty, up_ty, down_ty, dim, width, n_experts, k) in [
        (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0, 96, 64, 6, 2),
        (GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K, 256, 256, 6, 2),
        (GgmlType::BF16, GgmlType::BF16, GgmlType::F16, 96, 48, 6, 2),
        (GgmlType::Q4_1, GgmlType::Q4_1, GgmlType::F32, 96, 64, 6, 2),
        (GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0, 96, 64, 6, 2),
        (GgmlType::Q6K, GgmlType::Q6K, GgmlType::Q4K, 256, 256, 6, 2),
        (GgmlType::F16, GgmlType::F16, GgmlType::BF16, 96, 40, 6, 2),
        (GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q4K, 256, 512, 12, 9),
        // Q4_K down rows longer than a stage of CUDA's two-row warps (32 groups of 64 values).
        (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q4K, 96, 2304, 6, 2),
        (GgmlType::Fp8, GgmlType::Fp8, GgmlType::Fp8, 160, 96, 6, 2),
        // As many experts as Qwen3-30B-A3B has: more than a warp's lanes.
        (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0, 64, 32, 128, 8),
    ] {
        let routing = Routing {
            n_experts,
            k,
            renormalize: true,
        };
        let (mut gpu, mut cpu) = pair(&make);
        let (gate_g, gate_c) = random_experts(&mut rng, &mut gpu, &mut cpu, ty, [dim, width], n_experts);
        let (up_g, up_c) = random_experts(&mut rng, &mut gpu, &mut cpu, up_ty, [dim, width], n_experts);
        let (down_g, down_c) = random_experts(&mut rng, &mut gpu, &mut cpu, down_ty, [width, dim], n_experts);
        let set_g = ExpertSet {
            gate: &gate_g[..],
            up: &up_g[..],
            down: &down_g[..],
            activation: Activation::Silu,
        };
        let set_c = ExpertSet {
            gate: &gate_c[..],
            up: &up_c[..],
            down: &down_c[..],
            activation: Activation::Silu,
        };
        // Steps of up to 8 tokens take the backends' per-pair path, longer ones the grouped path
        // where a backend has one; the longest two also group unevenly.
        for n_tokens in [1, 7, 9, 33, 130, 300] {
            let case = format!("{ty}, {up_ty} and {down_ty}, {n_tokens} tokens");
            let pairs = n_tokens * k;
            // Halves, so that rows hold exact ties; the last row all equal.
            let mut logits: Vec<f32> = randn(&mut rng, n_tokens * n_experts)
                .iter()
                .map(|v| (v * 4.0).round() / 2.0)
                .collect();
            if n_tokens > 100 {
                // Expert 0 first for every token (the last row's tie chooses it too), the last
                // for none: a group of every token beside an empty one.
                for row in logits.chunks_mut(n_experts) {
                    row[0] += 16.0;
                    row[n_experts - 1] -= 16.0;
                }
            }
            let last = logits.len() - n_experts;
            logits[last..].fill(0.5);
            // Inputs a sixteenth of unit scale: weights of random bytes reach about 20 (K-quants'
            // scales), and at unit scale act(gate) * up passes f16's range, in which grouped
            // steps' tensor-core products take their inputs as prefill's GEMMs do.
            let x: Vec<f32> = randn(&mut rng, n_tokens * dim).iter().map(|v| v / 16.0).collect();
            let residual = randn(&mut rng, n_tokens * dim);
            let (rows, gates) = (randn(&mut rng, n_tokens * dim), randn(&mut rng, n_tokens));

            fn run<K: Backend>(
                b: &mut K,
                set: ExpertSet<'_, K::Weight>,
                routing: Routing,
                inputs: [&[f32]; 5],
                [dim, width, n_tokens]: [usize; 3],
            ) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>) {
                let [logits, x, residual, rows, gates] = inputs;
                let pairs = n_tokens * routing.k;
                let logits = put(b, logits);
                let routes = Routes {
                    ids: put_u32(b, &vec![u32::MAX; pairs]),
                    weights: poisoned(b, pairs),
                    k: routing.k,
                };
                b.route(logits, routes, n_tokens, routing).unwrap();
                let scratch = ExpertScratch {
                    rows: poisoned(b, pairs * dim),
                    gate: poisoned(b, pairs * width),
                    up: poisoned(b, pairs * width),
                    hidden: poisoned(b, pairs * width),
                    out: poisoned(b, pairs * dim),
                    groups: poisoned(b, ExpertScratch::groups_len(routing.n_experts, pairs)),
                };
                let (x, residual) = (put(b, x), put(b, residual));
                b.experts(x, set, routes, scratch, residual, n_tokens).unwrap();
                let (gated, rows, gates) = (put(b, &get(b, residual, n_tokens * dim)), put(b, rows), put(b, gates));
                b.add_gated(gated, rows, gates, n_tokens, dim).unwrap();
                let mut ids = vec![0u32; pairs];
                b.read_u32(routes.ids, &mut ids).unwrap();
                let n = n_tokens * dim;
                (
                    ids,
                    get(b, routes.weights, pairs),
                    get(b, residual, n),
                    get(b, gated, n),
                )
            }
            let inputs = [&logits[..], &x, &residual, &rows, &gates];
            let shape = [dim, width, n_tokens];
            let (ids_g, weights_g, experts_g, gated_g) = run(&mut gpu, set_g, routing, inputs, shape);
            let (ids_c, weights_c, experts_c, gated_c) = run(&mut cpu, set_c, routing, inputs, shape);
            assert_eq!(ids_g, ids_c, "{case}: routes");
            assert_eq!(ids_g.len(), pairs);
            let err = rel_l2(&weights_g, &weights_c);
            assert!(err < 1e-6, "{case}: route weights' relative error {err}");
            for (what, out) in [("experts", &experts_g), ("add_gated", &gated_g)] {
                let unwritten = out.iter().position(|v| !v.is_finite()).map(|i| (i / dim, i % dim));
                assert!(
                    unwritten.is_none(),
                    "{case}: {what}: (token, column) {unwritten:?} non-finite"
                );
            }
            let err = rel_l2(&experts_g, &experts_c);
            assert!(err < tolerance, "{case}: experts' relative error {err}");
            let err = rel_l2(&gated_g, &gated_c);
            assert!(err < tolerance, "{case}: add_gated's relative error {err}");
        }
    }
}

/// Whole mixture blocks (`Backend::mixture`) against the CPU reference, their input under an RMS
/// norm as the layer loop gives it: float routers (f32, bf16) over 6 experts of which each token
/// runs 2, over 12 of which each runs 9 and over 128 of which each runs 8, experts in Q8_0, Q4_K's
/// mix and f16, steps of 1 to 9
/// tokens (a backend may fuse the router into the routing for a few tokens). The same routes,
/// and the residual within `tolerance`.
pub fn mixture_blocks<B: Backend>(make: impl Fn() -> B, tolerance: f64) {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for (router_ty, [gate_ty, down_ty], dim, width, n_experts, k) in [
        (GgmlType::F32, [GgmlType::Q8_0, GgmlType::Q8_0], 96, 64, 6, 2),
        (GgmlType::BF16, [GgmlType::Q4K, GgmlType::Q6K], 256, 256, 12, 9),
        (GgmlType::F32, [GgmlType::F16, GgmlType::F16], 160, 96, 12, 9),
        (GgmlType::F32, [GgmlType::Q8_0, GgmlType::Q8_0], 64, 32, 128, 8),
    ] {
        let routing = Routing {
            n_experts,
            k,
            renormalize: true,
        };
        let (mut gpu, mut cpu) = pair(&make);
        let router = random_weight(&mut rng, &mut gpu, &mut cpu, router_ty, dim, n_experts);
        let gate = random_experts(&mut rng, &mut gpu, &mut cpu, gate_ty, [dim, width], n_experts);
        let up = random_experts(&mut rng, &mut gpu, &mut cpu, gate_ty, [dim, width], n_experts);
        let down = random_experts(&mut rng, &mut gpu, &mut cpu, down_ty, [width, dim], n_experts);
        // Longer steps' router products may go through a backend's GEMM staging.
        gpu.prepare(16, dim.max(width)).unwrap();
        for n_tokens in [1, 3, 8, 9] {
            let case = format!("router {router_ty}, experts {gate_ty} and {down_ty}, {n_tokens} tokens");
            // The norm's weights a sixteenth of unit scale, for f16's range as in expert_ops.
            let x = randn(&mut rng, n_tokens * dim);
            let norm: Vec<f32> = randn(&mut rng, dim).iter().map(|v| v / 16.0).collect();
            let residual = randn(&mut rng, n_tokens * dim);
            fn run<K: Backend>(
                b: &mut K,
                router: &K::Weight,
                experts: ExpertSet<'_, K::Weight>,
                routing: Routing,
                [x, norm, residual]: [&[f32]; 3],
                [dim, width, n_tokens]: [usize; 3],
            ) -> (Vec<u32>, Vec<f32>) {
                let pairs = n_tokens * routing.k;
                let (x, norm, stream) = (put(b, x), put(b, norm), put(b, residual));
                let input = normed(x, norm, poisoned(b, n_tokens * dim));
                let routes = Routes {
                    ids: put_u32(b, &vec![u32::MAX; pairs]),
                    weights: poisoned(b, pairs),
                    k: routing.k,
                };
                let rows = |b: &mut K, width| poisoned(b, pairs * width);
                let scratch = MixtureScratch {
                    logits: poisoned(b, n_tokens * routing.n_experts),
                    routes,
                    experts: ExpertScratch {
                        rows: rows(b, dim),
                        gate: rows(b, width),
                        up: rows(b, width),
                        hidden: rows(b, width),
                        out: rows(b, dim),
                        groups: poisoned(b, ExpertScratch::groups_len(routing.n_experts, pairs)),
                    },
                    shared: FeedForwardScratch {
                        gate: poisoned(b, 1),
                        up: poisoned(b, 1),
                        hidden: poisoned(b, 1),
                        proj: poisoned(b, 1),
                    },
                    shared_gates: poisoned(b, 1),
                };
                let mixture = Mixture {
                    router,
                    routing,
                    experts,
                    shared: None,
                };
                b.mixture(input, mixture, scratch, stream, n_tokens).unwrap();
                let mut ids = vec![0u32; pairs];
                b.read_u32(routes.ids, &mut ids).unwrap();
                (ids, get(b, stream, n_tokens * dim))
            }
            let inputs = [&x[..], &norm, &residual];
            let shape = [dim, width, n_tokens];
            let set_g = ExpertSet {
                gate: &gate.0[..],
                up: &up.0[..],
                down: &down.0[..],
                activation: Activation::Silu,
            };
            let set_c = ExpertSet {
                gate: &gate.1[..],
                up: &up.1[..],
                down: &down.1[..],
                activation: Activation::Silu,
            };
            let (ids_g, out_g) = run(&mut gpu, &router.0, set_g, routing, inputs, shape);
            let (ids_c, out_c) = run(&mut cpu, &router.1, set_c, routing, inputs, shape);
            assert_eq!(ids_g, ids_c, "{case}: routes");
            let err = rel_l2(&out_g, &out_c);
            assert!(err < tolerance, "{case}: relative error {err}");
        }
    }
}

/// The tiny models of every architecture (tests/fixtures/hf), decoded token by token, against
/// transformers' logits.
pub fn every_architecture_matches_transformers<B: Backend>(make: impl Fn(KvType) -> B) {
    fixtures_match_transformers(super::HF_FIXTURES, make, 0.0);
}

/// The tiny mixture-of-experts models, decoded token by token, against transformers' logits;
/// then converted to GGUF (f32, f16 and Q8_0, the experts stacked) and run a whole prompt a step,
/// so that steps of many tokens (the experts' grouped path, where a backend has one) are checked
/// too.
pub fn mixtures_of_experts_match_transformers<B: Backend>(make: impl Fn(KvType) -> B) {
    fixtures_match_transformers(super::MOE_FIXTURES, &make, 0.0);
    let dir = std::env::temp_dir().join(format!("axiom-gpu-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for &name in super::MOE_FIXTURES {
        let out = dir.join(format!("{name}-f32.gguf"));
        convert_hf_dir(&super::hf_fixture(name), &out, GgmlType::F32, |_, _, _| {}).unwrap();
        let err = super::worst_error(&out, &super::hf_fixture(name), make(KvType::F32));
        println!("{name} from f32 GGUF, whole prompts: relative L2 error {err:.2e}");
        assert!(err < 1e-4, "{name} f32 GGUF: relative L2 error {err}");
        // 16-bit and 8-bit weights, which a backend may multiply in 16 bits on its grouped path
        // (CUDA's tensor cores): the logits move a little, never wildly. Rounding can tip a token
        // near a tie to another expert, which moves its logits by a whole expert's output, so
        // the bounds are those of tests/convert.rs for the CPU's Q8_0.
        let tolerance = match name {
            "mixtral" => 0.1,
            "qwen3_moe" => 0.2,
            _ => 0.05,
        };
        for ty in [GgmlType::F16, GgmlType::Q8_0] {
            let out = dir.join(format!("{name}-{ty}.gguf"));
            convert_hf_dir(&super::hf_fixture(name), &out, ty, |_, _, _| {}).unwrap();
            let err = super::worst_error(&out, &super::hf_fixture(name), make(KvType::F32));
            println!("{name} from {ty} GGUF, whole prompts: relative L2 error {err:.2e}");
            assert!(err < tolerance, "{name} {ty} GGUF: relative L2 error {err}");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The tiny FP8 checkpoints (block-wise and per-channel scales), decoded token by token and run
/// a whole prompt a step (steps of 14 to 27 tokens: a backend's prompt kernels), against
/// transformers' logits on their dequantized weights; `prompt_bound` is the whole prompts'
/// relative error the backend's prompt kernels allow, `decode_rounding` what its one-token
/// kernels add to the f32 bounds of decoding (rounding activations to f16, say).
pub fn fp8_checkpoints_match_transformers<B: Backend>(
    make: impl Fn(KvType) -> B,
    prompt_bound: f64,
    decode_rounding: f64,
) {
    fixtures_match_transformers(super::FP8_FIXTURES, &make, decode_rounding);
    for &name in super::FP8_FIXTURES {
        let dir = super::hf_fixture(name);
        let err = super::worst_error(&dir, &dir, make(KvType::F32));
        println!("{name}, whole prompts: relative L2 error {err:.2e}");
        assert!(err < prompt_bound, "{name}, whole prompts: relative L2 error {err}");
    }
}

fn fixtures_match_transformers<B: Backend>(fixtures: &[&str], make: impl Fn(KvType) -> B, rounding: f64) {
    for &name in fixtures {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf")
            .join(name);
        let refs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap()).unwrap();
        let want: Vec<f32> = std::fs::read(dir.join("logits.bin"))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        // f32 weights and arithmetic: with an f32 KV cache the f32 bound, with f16 K and V a looser one.
        for (kv_type, bound) in [(KvType::F32, 1e-4 + rounding), (KvType::F16, 2e-3 + rounding)] {
            let backend = make(kv_type);
            let device = backend.device_name();
            let mut s = Session::load(
                &dir,
                backend,
                LoadOptions {
                    max_batch: 64,
                    kv_tokens: 64,
                    max_seqs: 1,
                },
            )
            .unwrap();
            let mut got = Vec::new();
            for ids in refs["ids"].as_array().unwrap() {
                let ids: Vec<u32> = ids
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect();
                // One token at a time, as decoding runs (the matrix-vector kernels and the graphs).
                let mut kv = s.model.new_kv_cache(64);
                for &id in &ids {
                    s.forward(&[id], &mut kv, LogitRows::Last, |_, l| got.extend_from_slice(l))
                        .unwrap();
                }
                s.pages.free(&mut kv);
            }
            let err = rel_l2(&got, &want);
            println!("{name} on {device}, {kv_type:?} KV cache: relative L2 error {err:.2e}");
            assert!(err < bound, "{name} {kv_type:?}: {err}");
        }
    }
}

/// Greedy decoding with the device a step ahead of the host ([`GreedyDecode`]) chooses what the
/// host's argmax of each step's logits chooses, and a decode stopped with a step queued leaves
/// the KV cache as if that step had never run: resumed, it goes on with the same tokens.
pub fn greedy_decode_matches_host_argmax<B: Backend>(backend: B) {
    // Steps of at most 5 tokens: the 8-token prompt runs in two, its last token in row 2.
    let mut s = Session::load(
        &super::hf_fixture("llama"),
        backend,
        LoadOptions {
            max_batch: 5,
            kv_tokens: 128,
            max_seqs: 1,
        },
    )
    .unwrap();
    let vocab = s.model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 5) % vocab).collect();
    let n = 40;
    let mut kv = s.model.new_kv_cache(128);
    let mut want = Vec::new();
    let mut logits = s.forward_last(&prompt, &mut kv).unwrap().to_vec();
    for i in 0..n {
        want.push(argmax(&logits));
        if i + 1 < n {
            logits = s.forward_last(&[want[i]], &mut kv).unwrap().to_vec();
        }
    }
    s.pages.free(&mut kv);

    let mut kv = s.model.new_kv_cache(128);
    let mut got = Vec::new();
    let mut decode = GreedyDecode::new(&mut s.model, &mut s.pages, &mut kv, &prompt).unwrap();
    for _ in 0..24 {
        got.push(decode.next_token(true).unwrap());
    }
    drop(decode);
    // 8 + 23 tokens and the 24th, whose queued step took a third page, dropped.
    assert_eq!(kv.tokens(), [&prompt[..], &want[..23]].concat());
    assert_eq!(s.pages.usage().used, 2);
    let mut decode = GreedyDecode::new(&mut s.model, &mut s.pages, &mut kv, &got[23..]).unwrap();
    for i in 24..n {
        got.push(decode.next_token(i + 1 < n).unwrap());
    }
    drop(decode);
    assert_eq!(got, want);
    assert_eq!(kv.len(), prompt.len() + n - 1);
}

/// For a backend whose steps claim batch invariance: a mixture of experts' row (route, then
/// experts added to the residual) for one token alone equals, to the bit, the same row computed
/// among 2 to 24 tokens (steps a backend may run per pair or grouped by expert), in Q4_K, Q8_0
/// and bf16, 6 experts of which each token runs 2.
pub fn expert_rows_do_not_depend_on_the_step<B: Backend>(make: impl Fn() -> B) {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (m_max, n_experts, k) = (24, 6, 2);
    let routing = Routing {
        n_experts,
        k,
        renormalize: true,
    };
    for (ty, dim, width) in [
        (GgmlType::Q4K, 256, 512),
        (GgmlType::Q8_0, 96, 64),
        (GgmlType::BF16, 96, 48),
    ] {
        let (mut b, mut cpu) = pair(&make);
        let (gate, _) = random_experts(&mut rng, &mut b, &mut cpu, ty, [dim, width], n_experts);
        let (up, _) = random_experts(&mut rng, &mut b, &mut cpu, ty, [dim, width], n_experts);
        let (down, _) = random_experts(&mut rng, &mut b, &mut cpu, ty, [width, dim], n_experts);
        let set = ExpertSet {
            gate: &gate[..],
            up: &up[..],
            down: &down[..],
            activation: Activation::Silu,
        };
        let (logits, x, residual) = (
            randn(&mut rng, m_max * n_experts),
            randn(&mut rng, m_max * dim),
            randn(&mut rng, m_max * dim),
        );
        let pairs = m_max * k;
        let (logits_h, x_h, sum) = (put(&mut b, &logits), put(&mut b, &x), poisoned(&mut b, m_max * dim));
        let routes = Routes {
            ids: put_u32(&mut b, &vec![u32::MAX; pairs]),
            weights: poisoned(&mut b, pairs),
            k,
        };
        let scratch = ExpertScratch {
            rows: poisoned(&mut b, pairs * dim),
            gate: poisoned(&mut b, pairs * width),
            up: poisoned(&mut b, pairs * width),
            hidden: poisoned(&mut b, pairs * width),
            out: poisoned(&mut b, pairs * dim),
            groups: poisoned(&mut b, ExpertScratch::groups_len(n_experts, pairs)),
        };
        // Tokens first..first + m's rows, each one's bits.
        let run = |first: usize, m: usize| -> Vec<u32> {
            let logits = logits_h.slice(first * n_experts * 4, m * n_experts * 4);
            let xs = x_h.slice(first * dim * 4, m * dim * 4);
            b.write_f32(sum, &residual[first * dim..(first + m) * dim]).unwrap();
            b.route(logits, routes, m, routing).unwrap();
            b.experts(xs, set, routes, scratch, sum, m).unwrap();
            bits(&get(&b, sum, m * dim))
        };
        let alone: Vec<Vec<u32>> = (0..m_max).map(|r| run(r, 1)).collect();
        for m in [2, 5, 8, 9, 16, 24] {
            let together = run(0, m);
            for (r, alone) in alone.iter().enumerate().take(m) {
                assert!(
                    together[r * dim..(r + 1) * dim] == alone[..],
                    "experts {ty}: row {r} among {m} tokens differs from it alone"
                );
            }
        }
    }
}

/// The bits of `v`, for comparisons that must hold exactly.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Steps of 1 to this many tokens are compared row by row by the batch-invariance checks below.
const INVARIANT_STEP: usize = 64;

/// For a backend whose steps claim batch invariance: a matmul's row for one token alone equals,
/// to the bit, the same row computed among m = 2..=64 tokens, for every weight type, on short
/// rows and long ones (where a backend may switch to integer kernels), in each way a layer
/// multiplies: rows as they are, RMS-normalized on the way in, added to a residual, and gate
/// and up with SwiGLU.
pub fn matmul_rows_do_not_depend_on_the_step<B: Backend>(make: impl Fn() -> B) {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let m_max = INVARIANT_STEP;
    for ty in weight_types() {
        let lengths: &[usize] = if ty.block_len() == 256 {
            &[512, 4352]
        } else {
            &[96, 2048]
        };
        for &n_in in lengths {
            let n_out = 37;
            let mut b = make();
            b.reserve(256 << 20).unwrap();
            let bytes = random_weight_bytes(&mut rng, ty, n_in * n_out);
            let tensor = HostTensor {
                name: "w",
                ty,
                dims: &[n_in, n_out],
                bytes: &bytes,
                region: None,
            };
            let w = b.upload_weight(&tensor).unwrap();
            b.prepare(m_max, n_in).unwrap();
            let (x, norm) = (randn(&mut rng, m_max * n_in), randn(&mut rng, n_in));
            let residual = randn(&mut rng, m_max * n_out);
            let (xh, nh) = (put(&mut b, &x), put(&mut b, &norm));
            let scratch = poisoned(&mut b, m_max * n_in);
            let [out, stream, sum, gate, up] = [(); 5].map(|_| poisoned(&mut b, m_max * n_out));
            // The four products of tokens first..first + m, each row's bits.
            let run = |first: usize, m: usize| -> [Vec<u32>; 4] {
                let xs = xh.slice(first * n_in * 4, m * n_in * 4);
                let n = m * n_out;
                b.matmul(xs, &w, out, m).unwrap();
                let plain = bits(&get(&b, out, n));
                b.matmul_many(normed(xs, nh, scratch), &[&w], &[out], m).unwrap();
                let normed_bits = bits(&get(&b, out, n));
                b.write_f32(stream, &residual[first * n_out..first * n_out + n])
                    .unwrap();
                b.matmul_add(xs, &w, residual_in(stream, sum), m).unwrap();
                let added = bits(&get(&b, stream, n));
                let rows = GluRows { gate, up, out };
                b.gate_up_glu(normed(xs, nh, scratch), [&w, &w], rows, m, Activation::Silu)
                    .unwrap();
                [plain, normed_bits, added, bits(&get(&b, out, n))]
            };
            let alone: Vec<[Vec<u32>; 4]> = (0..m_max).map(|r| run(r, 1)).collect();
            for m in 2..=m_max {
                let together = run(0, m);
                for (op, name) in ["matmul", "normed matmul", "matmul_add", "gate_up_glu"]
                    .iter()
                    .enumerate()
                {
                    for (r, alone) in alone.iter().enumerate().take(m) {
                        assert!(
                            together[op][r * n_out..(r + 1) * n_out] == alone[op][..],
                            "{name} {ty} [{n_out}, {n_in}]: row {r} among {m} tokens differs from it alone"
                        );
                    }
                }
            }
        }
    }
}

/// For a backend whose steps claim batch invariance: attention for one token alone equals, to
/// the bit, its row in a step of 64 sequences' decode tokens and a 40-token prompt chunk, over
/// contexts of 1 to 600 positions in an f16 cache, heads of 64 and 128, causal and with a
/// scale, a soft cap and a window.
pub fn attention_rows_do_not_depend_on_the_step<B: Backend>(make: impl Fn(KvType) -> B) {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let mut lens: Vec<usize> = (0..INVARIANT_STEP).map(|s| 1 + s * 89 % 600).collect();
    lens.push(100);
    let chunk = (60..100).map(|p| (INVARIANT_STEP as u32, p));
    let queries: Vec<(u32, u32)> = (0..INVARIANT_STEP)
        .map(|s| (s as u32, lens[s] as u32 - 1))
        .chain(chunk)
        .collect();
    for head_dim in [64, 128] {
        let shape = AttentionShape {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim,
        };
        for rule in [Scores::causal(head_dim), capped_window()] {
            let case = PagedCase::new(&mut rng, 16, &lens).scored(rule);
            let [k, v] = cached_kv(&mut rng, &lens, shape.kv_width(), KvType::F16);
            let q = randn(&mut rng, queries.len() * shape.q_width());
            let mut b = make(KvType::F16);
            b.reserve(512 << 20).unwrap();
            b.prepare(queries.len(), 64).unwrap();
            case.with_cache(&mut b, &k, &v, &queries, &q, shape, |b, qh, kv| {
                let qw = shape.q_width();
                let out = poisoned(b, queries.len() * qw);
                b.attention(qh, kv, out, queries.len(), shape)?;
                let together = bits(&get(b, out, queries.len() * qw));
                for (i, &(seq, pos)) in queries.iter().enumerate() {
                    let (token_seqs, positions) = (put_u32(b, &[seq]), put_u32(b, &[pos]));
                    let layout = StepLayout {
                        positions: &[pos],
                        token_seqs: &[seq],
                    };
                    let plan = b.plan_step(layout, shape)?;
                    let one = AttentionKv {
                        positions,
                        pages: PagedKv { token_seqs, ..kv.pages },
                        plan: &plan,
                        ..kv
                    };
                    let out = poisoned(b, qw);
                    b.attention(qh.slice(i * qw * 4, qw * 4), one, out, 1, shape)?;
                    assert!(
                        bits(&get(b, out, qw)) == together[i * qw..(i + 1) * qw],
                        "{shape:?}, {rule:?}: sequence {seq} at position {pos} alone differs from it among {} tokens",
                        queries.len()
                    );
                }
                Ok(())
            })
            .unwrap();
        }
    }
}
