//! The real default model end to end, checked against Hugging Face transformers' float32 outputs
//! (`refs/smollm2/hf_greedy.json`, `perplexity.json`), never against our own earlier output.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::kernels::argmax::argmax;
use axiom::backend::cpu::CpuBackend;
use axiom::chat::Message;
use axiom::engine::perplexity::perplexity;
use axiom::engine::{generate, GenerateOptions, Generation, Sampler, SamplerConfig, Session, StopReason};
use axiom::model::llama::LoadOptions;
use axiom::model::{KvCache, LogitRows};
use common::{ids, read_json, refs, smollm2};

/// The reference CPU backend computes exactly what transformers computes (f32 on the
/// dequantized weights); the fast one quantizes activations as llama.cpp does.
fn reference_session() -> Session<CpuBackend> {
    Session::load(
        &smollm2(),
        CpuBackend::reference(2),
        LoadOptions {
            max_batch: 512,
            kv_tokens: 512,
            max_seqs: 1,
        },
    )
    .unwrap()
}

fn fast_session() -> Session<CpuBackend> {
    Session::load(
        &smollm2(),
        CpuBackend::new(2),
        LoadOptions {
            max_batch: 512,
            kv_tokens: 512,
            max_seqs: 1,
        },
    )
    .unwrap()
}

fn last_logits(s: &mut Session<CpuBackend>, prompt: &[u32]) -> Vec<f32> {
    let mut kv = s.model.new_kv_cache(512);
    let logits = s.forward_last(prompt, &mut kv).unwrap().to_vec();
    s.pages.free(&mut kv);
    logits
}

fn prompt_of(s: &Session<CpuBackend>, case: &serde_json::Value) -> Vec<u32> {
    let text = case["text"].as_str().unwrap();
    match case["kind"].as_str().unwrap() {
        "chat" => s.chat_prompt(&[Message::new("user", text)]).unwrap(),
        _ => s.raw_prompt(text).unwrap(),
    }
}

/// Relative L2 error of our logits at transformers' top-20 ids.
fn top20_error(logits: &[f32], case: &serde_json::Value) -> f64 {
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for pair in case["top20_last"].as_array().unwrap() {
        let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap());
        err += (logits[id] as f64 - want).powi(2);
        norm += want * want;
    }
    (err / norm).sqrt()
}

#[test]
fn reference_backend_matches_transformers_prompts_logits_and_greedy_text() {
    let mut s = reference_session();
    let refs = read_json("hf_greedy.json");
    for case in refs["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = prompt_of(&s, case);
        assert_eq!(prompt, ids(&case["ids"]), "{name}: prompt ids");

        // Every position's argmax, and the last position's top-20 logits.
        let mut kv = s.model.new_kv_cache(512);
        let mut argmaxes = Vec::new();
        let mut last = Vec::new();
        s.forward(&prompt, &mut kv, LogitRows::From(0), |_, l| {
            argmaxes.push(argmax(l));
            last = l.to_vec();
        })
        .unwrap();
        assert_eq!(
            argmaxes,
            ids(&case["argmax_per_position"]),
            "{name}: argmax per position"
        );
        let rel = top20_error(&last, case);
        assert!(rel < 1e-4, "{name}: top-20 logits relative L2 error {rel}");

        // Greedy generation reproduces transformers' 64 tokens (which end at <|im_end|> if it came).
        let want = ids(&case["greedy64_ids"]);
        s.pages.truncate(&mut kv, 0);
        let mut sampler = Sampler::new(SamplerConfig::greedy());
        let g = run(&mut s, &mut kv, &prompt, &mut sampler, 64, &[], |_| {}).unwrap();
        let mut got = g.tokens.clone();
        if g.stop_reason == StopReason::EndOfGeneration {
            got.push(*want.last().unwrap());
        }
        assert_eq!(got, want, "{name}: greedy tokens");
        let want_text = case["greedy64_text"].as_str().unwrap();
        assert!(want_text.starts_with(&g.text), "{name}: {:?} vs {want_text:?}", g.text);
        s.pages.free(&mut kv);
    }
}

#[test]
fn fast_backend_first_tokens_and_logits_stay_close_to_transformers() {
    let mut s = fast_session();
    let refs = read_json("hf_greedy.json");
    for case in refs["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = prompt_of(&s, case);
        let logits = last_logits(&mut s, &prompt);
        assert_eq!(
            argmax(&logits),
            case["greedy64_ids"][0].as_u64().unwrap() as u32,
            "{name}: first token"
        );
        // llama.cpp's own error here is 5.7% on the first case.
        let rel = top20_error(&logits, case);
        assert!(rel < 0.03, "{name}: top-20 logits relative L2 error {rel}");
    }
}

fn apache_perplexity(s: &mut Session<CpuBackend>) -> f64 {
    let text = std::fs::read_to_string(refs("apache-2.0.txt")).unwrap();
    let tokens = s.tokenizer.encode(&text, false, false).unwrap();
    let got = perplexity(&mut s.model, &mut s.pages, &tokens, 512, None, |_, _, _| {}).unwrap();
    assert_eq!((got.chunks, got.scored_tokens), (4, 4 * 255));
    got.perplexity
}

#[test]
fn perplexity_matches_transformers_within_one_percent() {
    let want = read_json("perplexity.json")["hf_transformers_fp32"]["n_ctx_512"]
        .as_f64()
        .unwrap();
    for (name, mut s) in [("reference", reference_session()), ("fast", fast_session())] {
        let got = apache_perplexity(&mut s);
        assert!((got / want - 1.0).abs() < 0.01, "{name}: perplexity {got} vs {want}");
    }
}

/// Generates after `prompt` in `kv`, at most `max_tokens`, stopping before any of `stop`.
fn run(
    s: &mut Session<CpuBackend>,
    kv: &mut KvCache,
    prompt: &[u32],
    sampler: &mut Sampler,
    max_tokens: usize,
    stop: &[&str],
    on_text: impl FnMut(&str),
) -> axiom::Result<Generation> {
    let options = GenerateOptions {
        max_tokens,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    generate(s, kv, prompt, sampler, &options, on_text)
}

#[test]
fn stop_strings_and_token_limits() {
    let mut s = fast_session();
    let prompt = s.raw_prompt("The capital of France is").unwrap();
    let mut kv = s.model.new_kv_cache(512);
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    // Transformers continues " Paris.\n\nThe answer is: ...": stop at the blank line.
    let mut streamed = String::new();
    let g = run(&mut s, &mut kv, &prompt, &mut sampler, 64, &["\n\n"], |t| {
        streamed.push_str(t)
    })
    .unwrap();
    assert_eq!(g.stop_reason, StopReason::StopString);
    assert_eq!(g.text, " Paris.");
    assert_eq!(streamed, g.text);

    s.pages.truncate(&mut kv, 0);
    let g = run(&mut s, &mut kv, &prompt, &mut sampler, 3, &[], |_| {}).unwrap();
    assert_eq!((g.tokens.len(), g.stop_reason), (3, StopReason::MaxTokens));
    assert_eq!(kv.len(), prompt.len() + 2, "the last token is sampled but not run");

    // A context too small for the prompt is an error; one too small for the answer ends it early.
    s.pages.free(&mut kv);
    let mut small = s.model.new_kv_cache(4);
    assert!(run(&mut s, &mut small, &prompt, &mut sampler, 3, &[], |_| {}).is_err());
    let mut tight = s.model.new_kv_cache(prompt.len() + 1);
    let g = run(&mut s, &mut tight, &prompt, &mut sampler, 10, &[], |_| {}).unwrap();
    assert_eq!(g.stop_reason, StopReason::ContextFull);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let mut s = fast_session();
    let prompt = s
        .chat_prompt(&[Message::new("user", "Write a haiku about rust.")])
        .unwrap();
    let mut sample = |seed| {
        let mut kv = s.model.new_kv_cache(256);
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed,
            ..SamplerConfig::default()
        });
        let g = run(&mut s, &mut kv, &prompt, &mut sampler, 24, &[], |_| {}).unwrap();
        s.pages.free(&mut kv);
        g.tokens
    };
    let a = sample(42);
    assert_eq!(a, sample(42));
    assert_ne!(a, sample(43));
}
