//! Reproducible answers on the default model, for any backend that claims them
//! (tests/reproducible.rs on the CPU, tests/cuda.rs under `--deterministic`): a request's tokens
//! and log-probabilities do not depend on what else runs beside it, greedy or seeded, and a
//! prompt's logits do not depend, to the bit, on how its prefill was chunked or whether its
//! prefix came from the cache.

use axiom::backend::Backend;
use axiom::engine::scheduler::{Event, Metrics, Request, Scheduler, SchedulerConfig};
use axiom::engine::{SamplerConfig, Session};
use axiom::model::llama::LoadOptions;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

const NEW_TOKENS: usize = 32;

fn session<B: Backend>(make: &impl Fn() -> B, max_batch: usize, kv_tokens: usize) -> Session<B> {
    let options = LoadOptions {
        max_batch,
        kv_tokens,
        max_seqs: 16,
    };
    Session::load(&super::smollm2(), make(), options).unwrap()
}

#[derive(Default)]
struct Preemptions(AtomicUsize);
impl Metrics for Preemptions {
    fn preempted(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Eight prompts of about 20 to 130 tokens: the long ones are prefilled in several chunks.
fn prompts<B: Backend>(s: &Session<B>) -> Vec<Vec<u32>> {
    let subjects = ["a lighthouse keeper", "a baker", "a cartographer", "a beekeeper"];
    (0..8)
        .map(|i| {
            let text = format!(
                "In the year {}, {} wrote a letter that began:",
                1800 + 17 * i,
                subjects[i % 4]
            );
            s.tokenizer.encode(&text.repeat(1 + 3 * (i % 3)), true, true).unwrap()
        })
        .collect()
}

fn longest_prompt<B: Backend>(s: &Session<B>) -> Vec<u32> {
    prompts(s).into_iter().max_by_key(|p| p.len()).unwrap()
}

/// Greedy, or temperature 0.8 with `seed`.
fn sampling(seed: Option<u64>) -> SamplerConfig {
    match seed {
        None => SamplerConfig::greedy(),
        Some(seed) => SamplerConfig {
            temperature: 0.8,
            seed,
            ..SamplerConfig::default()
        },
    }
}

/// What a request gave.
struct Answer {
    tokens: Vec<u32>,
    /// Per token, when asked: the bits of its log-probability and of its top 5 (with their ids).
    logprobs: Vec<Vec<u32>>,
    cached_tokens: usize,
}

fn request(prompt: &[u32], seed: Option<u64>, logprobs: bool) -> (Request, Receiver<Event>) {
    let (tx, rx) = channel();
    let request = Request {
        prompt: prompt.to_vec(),
        sampling: sampling(seed),
        max_tokens: NEW_TOKENS,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        constraint: None,
        logprobs: logprobs.then_some(5),
        // Every answer runs its full length, so a late difference cannot hide behind an end.
        ignore_eos: true,
        sink: Box::new(tx),
    };
    (request, rx)
}

fn answer(rx: &Receiver<Event>) -> Answer {
    let (mut tokens, mut bits) = (Vec::new(), Vec::new());
    for event in rx.try_iter() {
        match event {
            Event::Token(t) => {
                tokens.push(t.id);
                if let Some(lp) = t.logprob {
                    let top = lp.top.iter().flat_map(|&(id, l)| [id, l.to_bits()]);
                    bits.push(std::iter::once(lp.logprob.to_bits()).chain(top).collect());
                }
            }
            Event::Done(done) => {
                assert_eq!(done.completion_tokens, NEW_TOKENS);
                return Answer {
                    tokens,
                    logprobs: bits,
                    cached_tokens: done.cached_tokens,
                };
            }
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("no Done event");
}

/// A prompt, its seed (greedy without one), and whether it asks for log-probabilities.
type Spec = (Vec<u32>, Option<u64>, bool);

/// Runs `batches` of requests through a fresh scheduler with steps of `max_batch` tokens and
/// `kv_tokens` of cache, each batch submitted at once and run to its end before the next.
/// Returns the answers in order and how many times a sequence was preempted.
fn serve<B: Backend>(
    make: &impl Fn() -> B,
    max_batch: usize,
    kv_tokens: usize,
    batches: &[Vec<Spec>],
) -> (Vec<Answer>, usize) {
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = session(make, max_batch, kv_tokens);
    let (sched, handle) = Scheduler::new(model, pages, Arc::new(tokenizer), SchedulerConfig::default());
    let preemptions = Arc::new(Preemptions::default());
    let mut sched = sched.with_metrics(preemptions.clone());
    let mut answers = Vec::new();
    for batch in batches {
        let rxs: Vec<_> = batch
            .iter()
            .map(|(prompt, seed, logprobs)| {
                let (request, rx) = request(prompt, *seed, *logprobs);
                handle.submit(request).unwrap();
                rx
            })
            .collect();
        while sched.step().unwrap() {}
        answers.extend(rxs.iter().map(answer));
    }
    (answers, preemptions.0.load(Ordering::Relaxed))
}

/// Eight requests alone, all together, and together in a cache small enough to preempt give the
/// same tokens and log-probabilities.
pub fn eight_requests_alone_and_together_give_the_same_answers<B: Backend>(make: impl Fn() -> B) {
    // Greedy ones without logprobs take the backend's argmax; seeded ones bring their logits back.
    let requests: Vec<Spec> = prompts(&session(&make, 64, 4096))
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, (i % 2 == 1).then_some(7 + i as u64), i % 2 == 1))
        .collect();
    let alone_batches: Vec<_> = requests.iter().map(|r| vec![r.clone()]).collect();
    // Fresh schedulers, so no run finds another's pages in the prefix cache. Together, the
    // prompts share a step's 64 tokens with each other and with the streams, so their chunks
    // differ; in a cache of 512 tokens, sequences are also preempted and recomputed.
    let (alone, _) = serve(&make, 64, 4096, &alone_batches);
    let (together, _) = serve(&make, 64, 4096, std::slice::from_ref(&requests));
    let (crowded, preempted) = serve(&make, 64, 512, std::slice::from_ref(&requests));
    assert!(preempted > 0, "the crowded run must preempt");
    for (how, answers) in [("together", &together), ("together and preempted", &crowded)] {
        for (i, (a, t)) in alone.iter().zip(answers).enumerate() {
            let what = format!("request {i} ({} prompt tokens) {how}", requests[i].0.len());
            assert_eq!(a.tokens, t.tokens, "{what}: tokens differ");
            assert_eq!(a.logprobs, t.logprobs, "{what}: log-probabilities differ");
        }
    }
    // The seeded answers are sampled: some of their tokens are not the most likely one.
    let unlikely = alone
        .iter()
        .flat_map(|a| a.logprobs.iter())
        .filter(|lp| lp[0] != lp[2])
        .count();
    assert!(unlikely >= 4, "only {unlikely} sampled tokens were not the most likely");
}

/// Prefills `prompt` in pieces of `chunk` tokens, after what the prefix cache holds of it if
/// `from_cache`; returns the bits of the last token's logits and frees the pages, which stay in
/// the prefix cache.
fn prefill<B: Backend>(s: &mut Session<B>, prompt: &[u32], from_cache: bool, chunk: usize) -> Vec<u32> {
    let mut kv = s.model.new_kv_cache(1024);
    let cached = if from_cache {
        s.pages.share_prefix(&mut kv, prompt)
    } else {
        0
    };
    assert_eq!(cached > 0, from_cache);
    for piece in prompt[cached..].chunks(chunk) {
        s.pages.reserve(&mut kv, piece.len()).unwrap();
        s.model.forward_last(piece, &mut kv).unwrap();
        s.pages.after_step(&mut kv);
    }
    let bits = s.model.last_logits().iter().map(|l| l.to_bits()).collect();
    s.pages.free(&mut kv);
    bits
}

/// A prompt of about 130 tokens prefilled whole, in chunks of 1, 3, 16 or 61, or after a prefix
/// from the cache gives bitwise the same logits.
pub fn a_prompts_logits_do_not_depend_on_chunking_or_the_prefix_cache<B: Backend>(make: impl Fn() -> B) {
    let mut s = session(&make, 512, 4096);
    let prompt = longest_prompt(&s);
    assert!(prompt.len() > 100, "{}", prompt.len());
    let whole = prefill(&mut s, &prompt, false, prompt.len());
    for chunk in [1, 3, 16, 61] {
        assert!(
            prefill(&mut s, &prompt, false, chunk) == whole,
            "prefilled {chunk} tokens at a time"
        );
    }
    for chunk in [1, 64, prompt.len()] {
        assert!(
            prefill(&mut s, &prompt, true, chunk) == whole,
            "from the cache, then {chunk} at a time"
        );
    }
}

/// A seeded answer is the same under steps of 512, 16 and 48 tokens, cold and from the cache.
pub fn a_seeded_answer_does_not_depend_on_the_step_size_or_the_prefix_cache<B: Backend>(make: impl Fn() -> B) {
    let prompt = longest_prompt(&session(&make, 64, 4096));
    let twice = [vec![(prompt.clone(), Some(3), true)], vec![(prompt, Some(3), true)]];
    // Cold, then with the prompt's full pages from the cache, under three step budgets.
    let runs = [512, 16, 48].map(|max_batch| (max_batch, serve(&make, max_batch, 4096, &twice).0));
    let reference = &runs[0].1[0];
    for (max_batch, answers) in &runs {
        assert_eq!(answers[0].cached_tokens, 0);
        assert!(answers[1].cached_tokens >= 64, "{}", answers[1].cached_tokens);
        for (got, how) in answers.iter().zip(["cold", "from the prefix cache"]) {
            let what = format!("steps of {max_batch} tokens, {how}");
            assert_eq!(got.tokens, reference.tokens, "{what}: tokens differ");
            assert_eq!(got.logprobs, reference.logprobs, "{what}: log-probabilities differ");
        }
    }
}
