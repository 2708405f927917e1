//! The CUDA backend against the CPU reference, op by op at awkward sizes, and the whole model
//! against Hugging Face transformers' outputs (the checks are in tests/common/gpu.rs, shared
//! with the Metal backend). These need an NVIDIA GPU and are left out of the default run; on a
//! GPU machine:
//!
//!     cargo test --release --test cuda -- --ignored
//!
//! (`scripts/cuda_device_tests.sh` does that on the device machine.) Without a GPU they fail.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cuda::CudaBackend;
use axiom::backend::KvType;
use axiom::format::quant::GgmlType;
use common::gpu;

fn cuda(kv_type: KvType) -> CudaBackend {
    CudaBackend::new(0).expect("a CUDA GPU").with_kv_type(kv_type)
}

/// The attention tests run with each flash-attention kernel the device has, as (groups of 64
/// query rows a block, on the warpgroup MMAs): the backend's own choice takes blocks of 128 rows
/// only for steps of thousands of tokens, and mma.sync only where there are no warpgroup MMAs.
fn flash_attention_kernels() -> Vec<impl Fn(KvType) -> CudaBackend> {
    let kinds = cuda(KvType::F16).flash_attention_kinds();
    let kernels = kinds.iter().flat_map(|&wg| [(1, wg), (2, wg)]);
    kernels
        .map(|(groups, wg)| move |kv_type| cuda(kv_type).with_flash_kernel(groups, wg).unwrap())
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn matmul_every_type_and_token_count_matches_the_cpu_reference() {
    gpu::matmul_every_type_and_token_count(
        || cuda(KvType::F16),
        |ty, n_in, n_tokens| {
            // Decode kernels compute in f32, except on quantized rows of 2048 or more, whose
            // activations are quantized to int8 per 32 values (about 0.4% each). cuBLAS takes
            // float weights from two tokens on and quantized ones (dequantized to f16) from
            // nine, with activations in the weights' 16-bit type (f32 weights: f32).
            let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            let via_cublas = n_tokens > if float { 1 } else { 8 };
            if via_cublas && ty != GgmlType::F32 {
                2e-3
            } else if !via_cublas && !float && n_in >= 2048 {
                1e-2
            } else {
                1e-5
            }
        },
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn embed_rms_norm_rope_glu_add_scale_softcap_match_the_cpu_reference() {
    gpu::embed_rms_norm_rope_glu_add_scale_softcap_argmax(|| cuda(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn attention_then_output_projection_matches_the_cpu_reference() {
    // Quantized projections of rows of 2048 run on int8 activations (about 0.4% each); bf16 ones
    // of three tokens go through cuBLAS, with bf16 activations. Steps of 32 tokens or more run
    // tensor-core attention (f16 queries and probabilities), which writes cuBLAS's 16-bit input.
    for make in flash_attention_kernels() {
        gpu::attention_then_output_projection(make, |ty, n_tokens| {
            if ty == GgmlType::BF16 && n_tokens < 32 {
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
    // go to the tensor-core kernel (f16 queries and probabilities), which rotates the queries.
    for make in flash_attention_kernels() {
        gpu::rope_attention_then_output_projection(make, |ty, kv_type, head_dim, n_tokens| {
            let flash = kv_type == KvType::F16 && matches!(head_dim, 64 | 128) && n_tokens >= 32;
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
    // kernel: f16 queries and probabilities.
    for make in flash_attention_kernels() {
        gpu::paged_kv_write_and_attention(make, |kv_type, head_dim| {
            if kv_type == KvType::F16 && matches!(head_dim, 64 | 128) {
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
    // kernel: f16 queries and probabilities.
    for make in flash_attention_kernels() {
        gpu::attention_scores(make, |kv_type, head_dim, n_tokens| {
            if kv_type == KvType::F16 && matches!(head_dim, 64 | 128) && n_tokens >= 32 {
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
    gpu::rope_kv_write_then_attention(cuda);
}

#[test]
#[ignore = "needs an NVIDIA GPU and the default model in the cache: see scripts/cuda_device_tests.sh"]
fn smollm2_on_cuda_matches_transformers() {
    gpu::smollm2_matches_transformers(cuda(KvType::F16));
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn every_architecture_on_cuda_matches_transformers() {
    gpu::every_architecture_matches_transformers(cuda);
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn mixtures_of_experts_on_cuda_match_transformers() {
    gpu::mixtures_of_experts_match_transformers(cuda);
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn expert_ops_match_the_cpu_reference() {
    // The expert products compute in f32 on the stored weights, as the CPU reference does.
    gpu::expert_ops(|| cuda(KvType::F16), 1e-5);
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release --test cuda -- --ignored"]
fn greedy_decode_on_cuda_matches_host_argmax() {
    gpu::greedy_decode_matches_host_argmax(cuda(KvType::F16));
}
