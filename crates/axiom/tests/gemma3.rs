//! Gemma 3 270M (its Q4_K_M GGUF, from PyPI) end to end against llama.cpp on the same file
//! (`refs/gemma3/`): tokenization, perplexity, greedy continuations.
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
use axiom::engine::Session;
use axiom::format::gguf::GgufFile;
use axiom::model::llama::LoadOptions;
use axiom::tokenizer::Tokenizer;
use common::ids;

fn session(backend: CpuBackend) -> Session<CpuBackend> {
    let options = LoadOptions {
        max_batch: 512,
        kv_tokens: 2048,
        max_seqs: 1,
    };
    Session::load(&common::gemma3_270m(), backend, options).unwrap()
}

fn gemma_refs(file: &str) -> serde_json::Value {
    let path = common::refs("../gemma3").join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn tokenizes_like_llama_cpp() {
    let tok = Tokenizer::from_gguf(&GgufFile::open(&common::gemma3_270m()).unwrap()).unwrap();
    let refs = gemma_refs("tokenization.json");
    for case in refs["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        for (mode, special, bos) in [
            ("parse_special", true, true),
            ("no_parse_special", false, true),
            ("parse_special_no_bos", true, false),
            ("no_parse_special_no_bos", false, false),
        ] {
            let want = ids(&case[mode]["ids"]);
            let got = tok.encode(text, special, bos).unwrap();
            assert_eq!(got, want, "{} ({mode}): {text:?}", case["name"]);
        }
    }
}

/// The fast backend (activations quantized as llama.cpp's are) within 1% of llama.cpp's perplexity
/// on the same file, in chunks of 512 and of 1024 (where the local layers' 512-token window
/// masks). The reference backend's exactness is `logits_match_transformers`'.
#[test]
fn perplexity_is_within_one_percent_of_llama_cpp() {
    let refs = gemma_refs("perplexity.json");
    let mut s = session(CpuBackend::new(2));
    let text = std::fs::read_to_string(common::refs("apache-2.0.txt")).unwrap();
    let tokens = s.tokenizer.encode(&text, false, true).unwrap();
    assert_eq!(tokens, ids(&refs["llama_cpp_token_ids"]), "the text's tokens");
    for (n_ctx, chunks) in [(512, 4), (1024, 2)] {
        let want = refs["llama_cpp_0c1e57098_cpu"][format!("n_ctx_{n_ctx}")]
            .as_f64()
            .unwrap();
        let got = perplexity(
            &mut s.model,
            &mut s.pages,
            &tokens,
            n_ctx,
            s.tokenizer.bos,
            |_, _, _| {},
        )
        .unwrap();
        assert_eq!((got.chunks, got.scored_tokens), (chunks, chunks * (n_ctx / 2 - 1)));
        assert!(
            (got.perplexity / want - 1.0).abs() < 0.01,
            "n_ctx {n_ctx}: perplexity {} vs llama.cpp's {want}",
            got.perplexity
        );
    }
}

/// Greedy continuations agree with llama.cpp's up to the first step where its top two logits are
/// within 0.5 (there two engines that round differently may pick differently), and chat prompts
/// from the built-in template are the ones llama.cpp was given.
#[test]
fn greedy_continuations_match_llama_cpp_until_a_near_tie() {
    let mut s = session(CpuBackend::new(2));
    let refs = gemma_refs("llamacpp_greedy.json");
    for case in refs["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        // llama.cpp's chat prompts were written in Gemma's turn format by hand: the built-in
        // template must render the same ids (a system message opens the user turn).
        if case["kind"] == "chat" {
            let text = case["prompt_text"].as_str().unwrap();
            let content = text
                .strip_prefix("<start_of_turn>user\n")
                .and_then(|t| t.strip_suffix("<end_of_turn>\n<start_of_turn>model\n"))
                .unwrap();
            let messages = match content.split_once("\n\n") {
                Some((system, user)) if name.contains("sys") => {
                    vec![Message::new("system", system), Message::new("user", user)]
                }
                _ => vec![Message::new("user", content)],
            };
            assert_eq!(
                s.chat_prompt(&messages).unwrap(),
                prompt,
                "{name}: the built-in template"
            );
        }
        let mut kv = s.model.new_kv_cache(1024);
        let mut logits = s.forward_last(&prompt, &mut kv).unwrap().to_vec();
        for step in case["steps"].as_array().unwrap() {
            let margin = step["logit"].as_f64().unwrap() - step["runner_up_logit"].as_f64().unwrap();
            if margin < 0.5 {
                break;
            }
            let got = argmax(&logits);
            assert_eq!(
                got as u64,
                step["id"].as_u64().unwrap(),
                "{name}: step {}",
                step["step"]
            );
            logits = s.forward_last(&[got], &mut kv).unwrap().to_vec();
        }
        s.pages.free(&mut kv);
    }
}

/// The reference backend computes what transformers computes in float32 on the same dequantized
/// weights: every prompt position's argmax, and the last position's 20 best logits. The fast
/// backend, which quantizes activations to 8 bits as llama.cpp does, comes within a few percent.
#[test]
fn logits_match_transformers() {
    for (backend, bound) in [(CpuBackend::reference(2), 1e-4), (CpuBackend::new(2), 0.05)] {
        check_against_transformers(session(backend), bound);
    }
}

fn check_against_transformers(mut s: Session<CpuBackend>, bound: f64) {
    let exact = bound < 1e-3;
    let refs = gemma_refs("hf_greedy.json");
    for case in refs["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["ids"]);
        let mut kv = s.model.new_kv_cache(1024);
        let mut argmaxes = Vec::new();
        let mut last = Vec::new();
        s.pages.reserve(&mut kv, prompt.len()).unwrap();
        s.model
            .forward(&prompt, &mut kv, axiom::model::LogitRows::From(0), |row, logits| {
                argmaxes.push(argmax(logits));
                if row + 1 == prompt.len() {
                    last = logits.to_vec();
                }
            })
            .unwrap();
        s.pages.free(&mut kv);
        if exact {
            assert_eq!(
                argmaxes,
                ids(&case["argmax_per_position"]),
                "{name}: argmax per position"
            );
        }
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for pair in case["top20_last"].as_array().unwrap() {
            let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap());
            diff += (last[id] as f64 - want).powi(2);
            norm += want * want;
        }
        let rel = (diff / norm).sqrt();
        assert!(rel < bound, "{name}: top-20 logits relative L2 error {rel}");
    }
}
