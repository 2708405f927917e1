//! The CUDA backend against the CPU reference, op by op at awkward sizes, and the whole model
//! against Hugging Face transformers' outputs (the checks are in tests/common/gpu.rs, shared
//! with the Metal backend). These need an NVIDIA GPU and are left out of the default run; on a
//! GPU machine:
//!
//!     cargo test --release --test cuda -- --ignored
//!
//! (`scripts/cuda_device_tests.sh` does that on the device machine.) Without a GPU they fail.
//! The kernel checks also run on `--deterministic`'s paths (`Paths::BatchInvariant`), where
//! the `deterministic_*` tests also require a row computed alone to equal it among 64, to the
//! bit, and SmolLM2's answers not to depend on the batch, the chunking or the prefix cache
//! (tests/common/reproducible.rs, which tests/reproducible.rs runs on the CPU).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cuda::{CudaBackend, Nccl, Paths};
use axiom::backend::{Kernels, KvType};
use axiom::engine::Session;
use axiom::format::quant::GgmlType;
use axiom::model::ModelFiles;
use axiom::parallel::{Communicator, Rank, Shard, Tcp};
use common::{gpu, reproducible, split};
use std::time::Duration;

fn cuda(kv_type: KvType) -> CudaBackend {
    CudaBackend::new(0).expect("a CUDA GPU").with_kv_type(kv_type)
}

/// The backend as `--deterministic` makes it: the same kernels for every step.
fn invariant(kv_type: KvType) -> CudaBackend {
    cuda(kv_type).with_paths(Paths::BatchInvariant)
}

/// Each kernel test runs on the default paths and on `--deterministic`'s.
const PATHS: [Paths; 2] = [Paths::Fastest, Paths::BatchInvariant];

fn on(paths: Paths) -> impl Fn(KvType) -> CudaBackend {
    move |kv_type| cuda(kv_type).with_paths(paths)
}

/// A CUDA backend with a KV cache of the type given.
type MakeCuda = Box<dyn Fn(KvType) -> CudaBackend>;

/// The attention tests run with each flash-attention kernel the device has, as (groups of 64
/// query rows a block, on the warpgroup MMAs): the backend's own choice takes blocks of 128 rows
/// only for steps of thousands of tokens, and mma.sync only where there are no warpgroup MMAs;
/// then once on `--deterministic`'s paths, which take no flash attention. Each comes with
/// whether its steps of 32 tokens or more take flash attention.
fn attention_backends() -> Vec<(MakeCuda, bool)> {
    let kinds = cuda(KvType::F16).flash_attention_kinds();
    let kernels = kinds.iter().flat_map(|&wg| [(1, wg), (2, wg)]);
    let mut backends: Vec<(MakeCuda, bool)> = kernels
        .map(|(groups, wg)| {
            let make = move |kv_type| cuda(kv_type).with_flash_kernel(groups, wg).unwrap();
            (Box::new(make) as MakeCuda, true)
        })
        .collect();
    backends.push((Box::new(invariant), false));
    backends
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn matmul_every_type_and_token_count_matches_the_cpu_reference() {
    for paths in PATHS {
        gpu::matmul_every_type_and_token_count(
            || cuda(KvType::F16).with_paths(paths),
            &gpu::weight_types(),
            |ty, n_in, n_tokens| {
                // Decode kernels compute in f32, except on quantized rows of 2048 or more, whose
                // activations are quantized to int8 per 32 values (about 0.4% each; not Q4_K's
                // under --deterministic, nor FP8's ever), and FP8's below. By default cuBLAS takes float weights
                // from two tokens on and quantized ones (dequantized to f16) from nine, with
                // activations in the weights' 16-bit type (f32 weights: f32); under
                // --deterministic, never.
                let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
                let via_cublas = paths == Paths::Fastest && n_tokens > if float { 1 } else { 8 };
                // FP8's matrix-vector kernels run on the tensor cores by default, activations
                // rounded to f16 as cuBLAS's are.
                let fp8_mma = ty == GgmlType::Fp8 && paths == Paths::Fastest;
                let int8 = !float
                    && ty != GgmlType::Fp8
                    && n_in >= 2048
                    && !(paths == Paths::BatchInvariant && ty == GgmlType::Q4K);
                if (via_cublas && ty != GgmlType::F32) || fp8_mma {
                    2e-3
                } else if !via_cublas && int8 {
                    1e-2
                } else {
                    1e-5
                }
            },
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn embed_rms_norm_rope_glu_add_scale_softcap_match_the_cpu_reference() {
    for paths in PATHS {
        gpu::embed_rms_norm_rope_glu_add_scale_softcap_argmax(
            || cuda(KvType::F16).with_paths(paths),
            &gpu::weight_types(),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn attention_then_output_projection_matches_the_cpu_reference() {
    // Quantized projections of rows of 2048 run on int8 activations (about 0.4% each); bf16 ones
    // of three tokens go through cuBLAS, with bf16 activations. Steps of 32 tokens or more run
    // tensor-core attention (f16 queries and probabilities), which writes cuBLAS's 16-bit input,
    // except under --deterministic.
    for (make, flash) in attention_backends() {
        gpu::attention_then_output_projection(make, |ty, n_tokens| {
            if ty == GgmlType::BF16 && !(flash && n_tokens >= 32) {
                2e-3
            } else {
                1e-2
            }
        });
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn rope_attention_then_output_projection_matches_the_cpu_reference() {
    // Steps of one token rotate and store inside attention; the Q4_K projection of rows of 2048
    // runs on int8 activations (about 0.4% each); an f16 cache rounds the rotated keys, which the
    // reference keeps in f32. Steps of 32 tokens or more with an f16 cache and heads of 64 or 128
    // go to the tensor-core kernel (f16 queries and probabilities), which rotates the queries,
    // except under --deterministic.
    for (make, flash_kernels) in attention_backends() {
        gpu::rope_attention_then_output_projection(make, |ty, kv_type, head_dim, n_tokens| {
            let flash = flash_kernels && kv_type == KvType::F16 && matches!(head_dim, 64 | 128) && n_tokens >= 32;
            match (ty, kv_type) {
                (Some(GgmlType::Q4K), _) => 1e-2,
                _ if flash => 5e-3,
                (_, KvType::F32) => 1e-5,
                (_, KvType::F16) => 1e-4,
            }
        });
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn paged_kv_write_and_attention_match_the_cpu_reference() {
    // Steps of 32 tokens or more with an f16 cache and heads of 64 or 128 go to the tensor-core
    // kernel (f16 queries and probabilities), except under --deterministic.
    for (make, flash) in attention_backends() {
        gpu::paged_kv_write_and_attention(make, |kv_type, head_dim| {
            if flash && kv_type == KvType::F16 && matches!(head_dim, 64 | 128) {
                5e-3
            } else {
                1e-5
            }
        });
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn attention_scores_match_the_cpu_reference() {
    // Steps of 32 tokens or more with an f16 cache and heads of 64 or 128 go to the tensor-core
    // kernel (f16 queries and probabilities), except under --deterministic.
    for (make, flash) in attention_backends() {
        gpu::attention_scores(make, |kv_type, head_dim, n_tokens| {
            if flash && kv_type == KvType::F16 && matches!(head_dim, 64 | 128) && n_tokens >= 32 {
                5e-3
            } else {
                1e-5
            }
        });
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn rope_kv_write_matches_the_cpu_reference() {
    for paths in PATHS {
        gpu::rope_kv_write_then_attention(on(paths));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and the default model in the cache: see scripts/cuda_device_tests.sh"]
fn smollm2_on_cuda_matches_transformers() {
    for paths in PATHS {
        gpu::smollm2_matches_transformers(on(paths)(KvType::F16));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn every_architecture_on_cuda_matches_transformers() {
    for paths in PATHS {
        gpu::every_architecture_matches_transformers(on(paths));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn fp8_checkpoints_on_cuda_match_transformers() {
    // Whole prompts dequantized for cuBLAS round every product's weights and activations to f16
    // (an f16 KV cache rounds only K and V, bound 2e-3): 5e-3; so do one token's products on the
    // tensor-core matrix-vector kernels, 3e-3 more than f32 arithmetic in decoding. Under
    // --deterministic both stay on the f32 kernels: 1e-4. On Hopper's FP8 tensor cores (the default there) each product's
    // activations are E4M3, about 2.6% off (fp8_prompt_products_match_the_cpu_reference), in
    // seven products a layer over two layers whose errors add in quadrature: about 0.1, as the
    // Qwen3 fixture measures; the Llama one twice that: 0.3. A wrong scale or layout is off by
    // the whole logits.
    let dequantized = |kv_type| cuda(kv_type).without_fp8_tensor_cores();
    gpu::fp8_checkpoints_match_transformers(dequantized, 5e-3, 3e-3);
    gpu::fp8_checkpoints_match_transformers(invariant, 1e-4, 0.0);
    if cuda(KvType::F16).fp8_tensor_cores() {
        gpu::fp8_checkpoints_match_transformers(on(Paths::Fastest), 0.3, 3e-3);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn fp8_prompt_products_match_the_cpu_reference() {
    // On Hopper the products run on the FP8 tensor cores, the activations quantized to E4M3 per
    // 128 values of a token. E4M3 keeps 3 mantissa bits: a value's rounding error is uniform over
    // half a unit in the last place, at most 2^-4 of it, 2^-4 / sqrt(3) times the RMS of 1 / m
    // for m uniform in [1, 2) (0.71) on average: about 2.6% RMS. A product sums those errors
    // against weights of random sign, independently, so its error relative to it is the
    // elements' own and does not shrink with n_in: bound 4e-2, and at least 5e-3, which only
    // E4M3 activations reach (through f16 the error is about 3e-4). The feed-forward block is
    // three products, two of them multiplied: three times the bound. Elsewhere, or with
    // AXIOM_CUDA_FP8_GEMM=dequant, they run through f16: 2e-3.
    let tensor_cores = cuda(KvType::F16).fp8_tensor_cores();
    let errors = gpu::fp8_prompt_products(
        || cuda(KvType::F16),
        |backend, w| assert_eq!(w.takes_fp8_tensor_cores(), backend.fp8_tensor_cores()),
    );
    let (low, high) = if tensor_cores { (5e-3, 4e-2) } else { (0.0, 2e-3) };
    for (case, err) in errors {
        println!("{case}: relative error {err:.2e}");
        let high = if case.starts_with("feed_forward") {
            3.0 * high
        } else {
            high
        };
        assert!(
            (low..high).contains(&err),
            "{case}: relative error {err}, outside [{low}, {high})"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn mixtures_of_experts_on_cuda_match_transformers() {
    gpu::mixtures_of_experts_match_transformers(cuda);
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn expert_ops_match_the_cpu_reference() {
    // Invariant, the expert products compute in f32 on the stored weights, as the CPU reference
    // does. By default, those of quantized experts over a few tokens run on int8 activations (as
    // the CPU's fast kernels, at their bound), and grouped steps (over 8 tokens) of all but f32
    // weights on the tensor cores, their inputs rounded to f16 (bf16 for bf16 weights).
    for paths in PATHS {
        let tolerance = if paths == Paths::Fastest { 2e-2 } else { 1e-5 };
        gpu::expert_ops(|| on(paths)(KvType::F16), tolerance);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn mixture_blocks_match_the_cpu_reference() {
    // As expert_ops; by default a few tokens' router and routing are one launch.
    for paths in PATHS {
        let tolerance = if paths == Paths::Fastest { 2e-2 } else { 1e-5 };
        gpu::mixture_blocks(|| on(paths)(KvType::F16), tolerance);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn greedy_decode_on_cuda_matches_host_argmax() {
    for paths in PATHS {
        gpu::greedy_decode_matches_host_argmax(on(paths)(KvType::F16));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn deterministic_matmul_rows_do_not_depend_on_the_step() {
    gpu::matmul_rows_do_not_depend_on_the_step(|| invariant(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn deterministic_expert_rows_do_not_depend_on_the_step() {
    gpu::expert_rows_do_not_depend_on_the_step(|| invariant(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn deterministic_attention_rows_do_not_depend_on_the_step() {
    gpu::attention_rows_do_not_depend_on_the_step(invariant);
}

#[test]
#[ignore = "needs an NVIDIA GPU and the default model in the cache: see scripts/cuda_device_tests.sh"]
fn deterministic_requests_alone_and_together_give_the_same_answers() {
    reproducible::eight_requests_alone_and_together_give_the_same_answers(|| invariant(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU and the default model in the cache: see scripts/cuda_device_tests.sh"]
fn deterministic_prompt_logits_do_not_depend_on_chunking_or_the_prefix_cache() {
    reproducible::a_prompts_logits_do_not_depend_on_chunking_or_the_prefix_cache(|| invariant(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU and the default model in the cache: see scripts/cuda_device_tests.sh"]
fn deterministic_seeded_answer_does_not_depend_on_the_step_size_or_the_prefix_cache() {
    reproducible::a_seeded_answer_does_not_depend_on_the_step_size_or_the_prefix_cache(|| invariant(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn tensor_parallel_shards_on_one_gpu_give_the_logits_of_one_rank() {
    // Split, the ranks' partial products are summed in another order and the attention's output
    // projection runs unfused: with an f32 cache within f32 arithmetic's bound, with an f16 one
    // within the bound the models keep against transformers. The o and down shards' rows must
    // still be whole 32-value groups, as CUDA's dense kernels take them.
    let mut splits = 0;
    for &name in common::HF_FIXTURES {
        let model = common::hf_fixture(name);
        let config = ModelFiles::open(&model).unwrap().config;
        let rows_fit = |n: usize| {
            (config.n_heads / n * config.head_dim).is_multiple_of(32) && (config.ffn_dim / n).is_multiple_of(32)
        };
        for ranks in [2, 4]
            .into_iter()
            .filter(|&n| Shard::new(&config, 0, n).is_ok() && rows_fit(n))
        {
            splits += 1;
            for (kv_type, bound) in [(KvType::F32, 1e-4), (KvType::F16, 2e-3)] {
                let what = format!("{name} on CUDA, {kv_type:?} cache");
                split::check_split(&model, ranks, &|| cuda(kv_type), bound, &what);
            }
        }
    }
    // Every fixture has 4 query heads, which split over 2 ranks at least.
    assert!(splits >= common::HF_FIXTURES.len(), "only {splits} splits ran");
}

/// A group of one rank through NCCL, met over TCP on the loopback.
fn nccl_alone(backend: &CudaBackend) -> Nccl {
    let tcp = Tcp::join("127.0.0.1:0", 0, 1, Duration::from_secs(5)).unwrap();
    Nccl::join(tcp, backend).expect("NCCL (libnccl.so on LD_LIBRARY_PATH)")
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: see scripts/cuda_device_tests.sh"]
fn nccl_alone_sums_and_gathers_and_runs_a_model_in_its_graphs() {
    let mut b = cuda(KvType::F16);
    let comm = nccl_alone(&b);
    b.reserve(1 << 16).unwrap();
    let (n, rows, width) = (1000, 3, 7);
    let (x, part, out) = (
        b.alloc(n * 4).unwrap(),
        b.alloc(rows * width * 4).unwrap(),
        b.alloc(rows * width * 4).unwrap(),
    );
    let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    b.write_f32(x, &values).unwrap();
    comm.all_reduce_sum(&b, x, n).unwrap();
    let mut sum = vec![0f32; n];
    b.read_f32(x, &mut sum).unwrap();
    assert_eq!(sum, values);
    b.write_f32(part, &values[..rows * width]).unwrap();
    comm.all_gather(&b, part, out, rows, &[width]).unwrap();
    let mut gathered = vec![0f32; rows * width];
    b.read_f32(out, &mut gathered).unwrap();
    assert_eq!(gathered, &values[..rows * width]);
    drop(comm);

    // A model as the one rank of an NCCL group takes the split model's path, its collectives
    // recorded in the decode steps' graphs, and gives the logits of the model loaded alone.
    let model = common::hf_fixture("llama");
    let whole = split::run(&mut split::load(&model, 1, &|| cuda(KvType::F32)).unwrap());
    let backend = cuda(KvType::F32);
    let comm = nccl_alone(&backend);
    let rank = Rank {
        backend,
        comm: Box::new(comm),
    };
    let mut s = Session::from_files_rank(ModelFiles::open(&model).unwrap(), rank, split::OPTIONS).unwrap();
    split::check_alike(
        split::run(&mut s),
        &whole,
        1e-4,
        "llama as the one rank of an NCCL group",
    );
}
