//! Model files that are valid GGUF but not a runnable model get errors that name the problem.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::engine::Session;
use axiom::format::gguf::GgufFile;
use axiom::model::llama::LoadOptions;
use common::GgufWriter;

/// A one-layer Llama (hidden 32, 2 heads over 1 KV head, FFN 64, vocab 8) with F32 weights.
/// `arch` and `skip`/`bad_shape`/`extra` (a vector of the hidden size) let a test break one thing.
fn tiny_llama(arch: &str, skip: Option<&str>, bad_shape: Option<&str>, extra: Option<&str>) -> Vec<u8> {
    let (dim, ffn, vocab, kv) = (32u64, 64u64, 8u64, 16u64);
    let mut tensors: Vec<(&str, Vec<u64>)> = vec![
        ("token_embd.weight", vec![dim, vocab]),
        ("output_norm.weight", vec![dim]),
        ("blk.0.attn_norm.weight", vec![dim]),
        ("blk.0.attn_q.weight", vec![dim, dim]),
        ("blk.0.attn_k.weight", vec![dim, kv]),
        ("blk.0.attn_v.weight", vec![dim, kv]),
        ("blk.0.attn_output.weight", vec![dim, dim]),
        ("blk.0.ffn_norm.weight", vec![dim]),
        ("blk.0.ffn_gate.weight", vec![dim, ffn]),
        ("blk.0.ffn_up.weight", vec![dim, ffn]),
        ("blk.0.ffn_down.weight", vec![ffn, dim]),
    ];
    tensors.retain(|(n, _)| Some(*n) != skip);
    tensors.extend(extra.map(|n| (n, vec![dim])));
    for (n, dims) in tensors.iter_mut() {
        if Some(*n) == bad_shape {
            dims[0] += 32;
        }
    }
    let tokens = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let mut w = GgufWriter::header(3, tensors.len() as u64, 11);
    w.kv_string("general.architecture", arch)
        .kv_u32(&format!("{arch}.block_count"), 1)
        .kv_u32(&format!("{arch}.embedding_length"), dim as u32)
        .kv_u32(&format!("{arch}.feed_forward_length"), ffn as u32)
        .kv_u32(&format!("{arch}.attention.head_count"), 2)
        .kv_u32(&format!("{arch}.attention.head_count_kv"), 1)
        .kv_u32(&format!("{arch}.context_length"), 64)
        .kv_string("tokenizer.ggml.model", "gpt2")
        .kv_strings("tokenizer.ggml.tokens", &tokens)
        .kv_strings("tokenizer.ggml.merges", &[])
        .kv_u32("tokenizer.ggml.eos_token_id", 7);
    let mut offset = 0;
    for (name, dims) in &tensors {
        w.tensor_info(name, dims, 0, offset);
        offset += (dims.iter().product::<u64>() * 4).next_multiple_of(32);
    }
    w.align();
    w.bytes(&vec![0u8; offset as usize]);
    // Small nonzero weights so the forward pass computes something.
    let n = w.buf.len();
    for (i, chunk) in w.buf[n - offset as usize..].chunks_exact_mut(4).enumerate() {
        chunk.copy_from_slice(&(((i % 13) as f32 - 6.0) * 0.01).to_le_bytes());
    }
    w.buf
}

fn load(bytes: &[u8]) -> axiom::Result<Session<CpuBackend>> {
    let file = GgufFile::from_bytes(bytes)?;
    Session::from_gguf(
        &file,
        CpuBackend::new(1),
        LoadOptions {
            max_batch: 4,
            kv_tokens: 16,
            max_seqs: 1,
        },
    )
}

#[test]
fn tiny_model_runs() {
    let mut s = load(&tiny_llama("llama", None, None, None)).unwrap();
    let mut kv = s.model.new_kv_cache(16);
    // Longer than max_batch: the prompt is split into steps.
    let logits = s.forward_last(&[1, 2, 3, 4, 5, 6], &mut kv).unwrap();
    assert_eq!(logits.len(), 8);
    assert!(logits.iter().all(|l| l.is_finite()));
    assert_eq!(kv.len(), 6);
    assert!(s.forward_last(&[8], &mut kv).is_err(), "a token id past the vocabulary");
    assert!(s.forward_last(&[0; 11], &mut kv).is_err(), "past the cache capacity");
}

#[test]
fn unrunnable_models_are_named() {
    let cases = [
        (tiny_llama("gptneox", None, None, None), "gptneox"),
        (
            tiny_llama("llama", Some("blk.0.ffn_up.weight"), None, None),
            "missing tensor blk.0.ffn_up.weight",
        ),
        (
            tiny_llama("llama", None, Some("blk.0.attn_k.weight"), None),
            "tensor blk.0.attn_k.weight has shape [64, 16], expected [32, 16]",
        ),
        // Tensors the engine would not read: a bias it does not apply, a layer past the count.
        (
            tiny_llama("llama", None, None, Some("blk.0.ffn_down.bias")),
            "does not use: blk.0.ffn_down.bias",
        ),
        (
            tiny_llama("llama", None, None, Some("blk.1.attn_norm.weight")),
            "does not use: blk.1.attn_norm.weight",
        ),
    ];
    for (bytes, needle) in cases {
        let err = load(&bytes).err().expect("load fails").to_string();
        assert!(err.contains(needle), "{err}");
    }
}
