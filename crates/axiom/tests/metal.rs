//! The Metal backend against the CPU reference, op by op at awkward sizes, and the whole model
//! against Hugging Face transformers' outputs (the checks in tests/common/gpu.rs, shared with
//! CUDA). They run on a Mac with `cargo test --release --test metal`; the Metal backend's context,
//! allocator and device tests are unit tests in src/backend/metal/. Elsewhere this file is only
//! type-checked (scripts/metal_check.sh); the kernels themselves are tested on Linux through
//! crates/metal-on-cpu.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]
#![cfg(any(target_vendor = "apple", axiom_metal_check))]

mod common;

use axiom::backend::metal::MetalBackend;
use axiom::backend::KvType;
use common::gpu;

fn metal(kv_type: KvType) -> MetalBackend {
    MetalBackend::new().expect("a Metal GPU").with_kv_type(kv_type)
}

#[test]
fn matmul_every_type_and_token_count_matches_the_cpu_reference() {
    // Every matmul decodes the stored blocks and accumulates in f32.
    gpu::matmul_every_type_and_token_count(|| metal(KvType::F16), &gpu::weight_types(), |_, _, _| 1e-5);
}

#[test]
fn embed_rms_norm_rope_glu_add_scale_softcap_match_the_cpu_reference() {
    gpu::embed_rms_norm_rope_glu_add_scale_softcap_argmax(|| metal(KvType::F16), &gpu::weight_types());
}

#[test]
fn paged_kv_write_and_attention_match_the_cpu_reference() {
    gpu::paged_kv_write_and_attention(metal, |_, _| 1e-5);
}

#[test]
fn attention_scores_match_the_cpu_reference() {
    gpu::attention_scores(metal, |_, _, _| 1e-5);
}

#[test]
fn attention_then_output_projection_matches_the_cpu_reference() {
    gpu::attention_then_output_projection(metal, |_, _| 1e-5);
}

#[test]
fn rope_attention_then_output_projection_matches_the_cpu_reference() {
    gpu::rope_attention_then_output_projection(
        metal,
        |_, kv_type, _, _| if kv_type == KvType::F16 { 1e-4 } else { 1e-5 },
    );
}

#[test]
fn rope_kv_write_matches_the_cpu_reference() {
    gpu::rope_kv_write_then_attention(metal);
}

#[test]
fn smollm2_on_metal_matches_transformers() {
    gpu::smollm2_matches_transformers(metal(KvType::F16));
}

#[test]
fn every_architecture_on_metal_matches_transformers() {
    gpu::every_architecture_matches_transformers(metal);
}

#[test]
fn fp8_checkpoints_on_metal_match_transformers() {
    gpu::fp8_checkpoints_match_transformers(metal, 1e-4, 0.0);
}

#[test]
fn expert_ops_match_the_cpu_reference() {
    gpu::expert_ops(|| metal(KvType::F16), 1e-5);
}

#[test]
fn mixtures_of_experts_on_metal_match_transformers() {
    gpu::mixtures_of_experts_match_transformers(metal);
}

#[test]
fn greedy_decode_on_metal_matches_host_argmax() {
    gpu::greedy_decode_matches_host_argmax(metal(KvType::F16));
}
