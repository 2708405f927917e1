//! Continuous batching on the real default model (fast CPU backend): a greedy request gives the
//! same tokens alone or among 31 others, through chunked prompts, preemption and shared
//! prefixes; a cancelled request frees its pages at once. A tiny mixture of experts too.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::engine::scheduler::{
    Completion, EngineHandle, Event, FinishReason, Metrics, Request, Scheduler, SchedulerConfig, SubmitError,
};
use axiom::engine::{SamplerConfig, Session};
use axiom::model::llama::LoadOptions;
use axiom::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

fn scheduler(options: LoadOptions) -> (Scheduler<CpuBackend>, EngineHandle, Arc<Tokenizer>) {
    scheduler_of(&common::smollm2(), options, SchedulerConfig::default())
}

fn scheduler_of(
    model: &std::path::Path,
    options: LoadOptions,
    config: SchedulerConfig,
) -> (Scheduler<CpuBackend>, EngineHandle, Arc<Tokenizer>) {
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = Session::load(model, CpuBackend::new(2), options).unwrap();
    let tokenizer = Arc::new(tokenizer);
    let (sched, handle) = Scheduler::new(model, pages, tokenizer.clone(), config);
    (sched, handle, tokenizer)
}

#[derive(Default)]
struct Preemptions(AtomicUsize);
impl Metrics for Preemptions {
    fn preempted(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn raw(t: &Tokenizer, text: &str) -> Vec<u32> {
    t.encode(text, true, true).unwrap()
}

fn prompts(t: &Tokenizer, n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let subject = ["a fruit seller", "a river pilot", "a painter", "a carpenter"][i % 4];
            let text = format!("Once upon a time, in town number {i}, there lived {subject} who");
            raw(t, &text.repeat(1 + i % 3))
        })
        .collect()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize, sink: Sender<Event>) -> Request {
    Request {
        prompt,
        sampling: SamplerConfig::greedy(),
        max_tokens,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        constraint: None,
        logprobs: None,
        ignore_eos: false,
        sink: Box::new(sink),
    }
}

fn submit(handle: &EngineHandle, prompt: Vec<u32>, max_tokens: usize) -> Receiver<Event> {
    let (tx, rx) = channel();
    handle.submit(greedy(prompt, max_tokens, tx)).unwrap();
    rx
}

fn collect(rx: &Receiver<Event>) -> (Vec<u32>, Completion) {
    let mut tokens = Vec::new();
    for event in rx.try_iter() {
        match event {
            Event::Token(t) => tokens.push(t.id),
            Event::Done(c) => return (tokens, c),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("no Done event");
}

fn run_all(sched: &mut Scheduler<CpuBackend>) {
    while sched.step().unwrap() {}
}

/// Each prompt's greedy output run alone.
fn solo(
    sched: &mut Scheduler<CpuBackend>,
    handle: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let rx = submit(handle, p.clone(), max_tokens);
            run_all(sched);
            collect(&rx).0
        })
        .collect()
}

#[test]
fn thirty_two_requests_together_give_their_solo_outputs() {
    let (mut sched, handle, s) = scheduler(LoadOptions {
        max_batch: 64,
        kv_tokens: 4096,
        max_seqs: 32,
    });
    let mut prompts = prompts(&s, 31);
    // One prompt longer than a step's token budget: it is prefilled in chunks beside the streams.
    prompts.push(raw(&s, &"The history of the river is long and winding. ".repeat(15)));
    assert!(prompts[31].len() > 64);
    let max_tokens = 12;
    let alone = solo(&mut sched, &handle, &prompts, max_tokens);
    let rxs: Vec<_> = prompts.iter().map(|p| submit(&handle, p.clone(), max_tokens)).collect();
    run_all(&mut sched);
    for (i, rx) in rxs.iter().enumerate() {
        let (tokens, done) = collect(rx);
        assert_eq!(tokens, alone[i], "request {i} differs when batched");
        assert_eq!(done.completion_tokens, tokens.len());
    }
    let full = alone.iter().filter(|t| t.len() == max_tokens).count();
    assert!(full >= 24, "most requests run to max_tokens ({full} of 32 do)");
    let status = handle.status();
    assert_eq!((status.running, status.queued, status.pages.used), (0, 0, 0));
}

#[test]
fn a_mixture_of_experts_model_gives_its_solo_outputs_batched() {
    // Tokens of one step choose different experts: each must get its own, batched or not,
    // through chunked prompts and shared prefixes.
    let (mut sched, handle, s) = scheduler_of(
        &common::hf_fixture("qwen3_moe"),
        LoadOptions {
            max_batch: 16,
            kv_tokens: 1024,
            max_seqs: 8,
        },
        SchedulerConfig::default(),
    );
    let mut prompts = prompts(&s, 7);
    prompts.push(raw(&s, &"The license applies to every contribution. ".repeat(4)));
    assert!(prompts.iter().any(|p| p.len() > 16));
    let max_tokens = 16;
    let alone = solo(&mut sched, &handle, &prompts, max_tokens);
    let rxs: Vec<_> = prompts.iter().map(|p| submit(&handle, p.clone(), max_tokens)).collect();
    run_all(&mut sched);
    for (i, rx) in rxs.iter().enumerate() {
        assert_eq!(collect(rx).0, alone[i], "request {i} differs when batched");
    }
    assert!(alone.iter().any(|t| t.len() == max_tokens), "{alone:?}");
    assert_eq!(handle.status().pages.used, 0);
}

/// Each planned step's (decode tokens, prompt tokens).
#[derive(Default)]
struct Plans(Mutex<Vec<(usize, usize)>>);
impl Metrics for Plans {
    fn step_planned(&self, decode_tokens: usize, prompt_tokens: usize) {
        self.0.lock().unwrap().push((decode_tokens, prompt_tokens));
    }
}
impl Plans {
    fn take(&self) -> Vec<(usize, usize)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[test]
fn an_idle_step_takes_a_whole_batch_of_prompt_and_a_busy_one_stays_bounded() {
    let (max_batch, busy) = (256, 48);
    let options = LoadOptions {
        max_batch,
        kv_tokens: 4096,
        max_seqs: 8,
    };
    let config = SchedulerConfig {
        decode_batch_tokens: busy,
        ..SchedulerConfig::default()
    };
    let (sched, handle, s) = scheduler_of(&common::smollm2(), options, config);
    let plans = Arc::new(Plans::default());
    let mut sched = sched.with_metrics(plans.clone());

    // Idle: a long prompt alone is prefilled in steps of max_batch.
    let idle_prompt = raw(&s, &"The history of the river is long and winding. ".repeat(60));
    let n = idle_prompt.len();
    assert!(n > 2 * max_batch, "{n} tokens");
    let rx = submit(&handle, idle_prompt, 2);
    run_all(&mut sched);
    collect(&rx);
    let prefill: Vec<_> = plans
        .take()
        .into_iter()
        .take_while(|&(decode, _)| decode == 0)
        .collect();
    let expected: Vec<_> = (0..n.div_ceil(max_batch))
        .map(|k| (0, max_batch.min(n - k * max_batch)))
        .collect();
    assert_eq!(prefill, expected);

    // Busy: two streams decode while another long prompt arrives; every step holds at most `busy`
    // tokens, and the streams get theirs in each.
    let streams: Vec<_> = prompts(&s, 2)
        .into_iter()
        .map(|p| {
            let (tx, rx) = channel();
            let request = Request {
                ignore_eos: true,
                ..greedy(p, 40, tx)
            };
            handle.submit(request).unwrap();
            rx
        })
        .collect();
    sched.step().unwrap();
    plans.take();
    let busy_prompt = raw(&s, &"A mountain road climbs slowly past the old mill. ".repeat(40));
    assert!(busy_prompt.len() > 4 * busy, "{} tokens", busy_prompt.len());
    let rx = submit(&handle, busy_prompt.clone(), 8);
    run_all(&mut sched);
    let plans = plans.take();
    let shared: Vec<_> = plans
        .iter()
        .filter(|&&(decode, prompt)| decode > 0 && prompt > 0)
        .collect();
    assert!(shared.len() >= 4, "{plans:?}");
    for &(decode, prompt) in &plans {
        assert!(decode == 0 || decode + prompt <= busy, "{plans:?}");
    }
    assert!(
        plans.iter().take(shared.len()).all(|&(decode, _)| decode == 2),
        "{plans:?}"
    );
    for stream in &streams {
        assert_eq!(collect(stream).0.len(), 40);
    }
    // Its output is that of a fresh run alone, prefilled in whole steps.
    let (batched, _) = collect(&rx);
    let (mut fresh, fresh_handle, _) = scheduler(options);
    assert_eq!(solo(&mut fresh, &fresh_handle, &[busy_prompt], 8)[0], batched);
}

#[test]
fn preempted_sequences_are_recomputed_and_give_the_same_tokens() {
    // Room for about two of these sequences at once: the rest wait or are preempted.
    let (sched, handle, s) = scheduler(LoadOptions {
        max_batch: 128,
        kv_tokens: 160,
        max_seqs: 8,
    });
    let preemptions = Arc::new(Preemptions::default());
    let mut sched = sched.with_metrics(preemptions.clone());
    let prompts = prompts(&s, 6);
    let max_tokens = 40;
    let alone = solo(&mut sched, &handle, &prompts, max_tokens);
    assert_eq!(preemptions.0.load(Ordering::Relaxed), 0, "alone, each fits");
    let rxs: Vec<_> = prompts.iter().map(|p| submit(&handle, p.clone(), max_tokens)).collect();
    run_all(&mut sched);
    for (i, rx) in rxs.iter().enumerate() {
        assert_eq!(collect(rx).0, alone[i], "request {i}");
        assert_eq!(alone[i].len(), max_tokens, "request {i} runs to max_tokens");
    }
    assert!(preemptions.0.load(Ordering::Relaxed) > 0, "the test must preempt");
    assert_eq!(handle.status().pages.used, 0);
}

#[test]
fn a_repeated_prompt_reuses_cached_pages() {
    let (mut sched, handle, s) = scheduler(LoadOptions {
        max_batch: 256,
        kv_tokens: 2048,
        max_seqs: 4,
    });
    let system = "You are a helpful assistant who answers in one short sentence. ".repeat(4);
    let first = raw(&s, &format!("{system}Question: what is rust?"));
    let second = raw(&s, &format!("{system}Question: what is iron?"));
    let rx = submit(&handle, first.clone(), 8);
    run_all(&mut sched);
    let (_, done) = collect(&rx);
    assert_eq!(done.cached_tokens, 0);
    // The shared system text is reused in whole pages; the answer is what a fresh run gives.
    let rx = submit(&handle, second.clone(), 8);
    run_all(&mut sched);
    let (tokens, done) = collect(&rx);
    let common = first.iter().zip(&second).take_while(|(a, b)| a == b).count();
    assert_eq!(done.cached_tokens, common / 16 * 16);
    assert!(done.cached_tokens >= 32);
    let (mut fresh, fresh_handle, _) = scheduler(LoadOptions {
        max_batch: 256,
        kv_tokens: 2048,
        max_seqs: 4,
    });
    assert_eq!(solo(&mut fresh, &fresh_handle, &[second], 8)[0], tokens);
}

#[test]
fn a_cancelled_request_frees_its_pages_and_the_others_go_on() {
    let (mut sched, handle, s) = scheduler(LoadOptions {
        max_batch: 64,
        kv_tokens: 1024,
        max_seqs: 4,
    });
    let prompts = prompts(&s, 2);
    let keep = submit(&handle, prompts[0].clone(), 20);
    let cancel = submit(&handle, prompts[1].clone(), 200);
    for _ in 0..5 {
        sched.step().unwrap();
    }
    assert!(handle.status().pages.used > 0, "{:?}", handle.status());
    drop(cancel);
    run_all(&mut sched);
    let (tokens, done) = collect(&keep);
    assert_eq!((tokens.len(), done.finish), (20, FinishReason::Length));
    assert_eq!(handle.status().pages.used, 0);
}

#[test]
fn requests_that_cannot_run_are_refused_up_front() {
    let (_sched, handle, _) = scheduler(LoadOptions {
        max_batch: 64,
        kv_tokens: 256,
        max_seqs: 2,
    });
    let (tx, _rx) = channel();
    let request = |prompt: Vec<u32>, max_tokens| greedy(prompt, max_tokens, tx.clone());
    assert_eq!(handle.submit(request(vec![], 4)), Err(SubmitError::EmptyPrompt));
    assert_eq!(
        handle.submit(request(vec![1; 200], 100)),
        Err(SubmitError::TooLong {
            prompt: 200,
            max_tokens: 100,
            context: 256
        })
    );
    handle.shut_down();
    assert_eq!(handle.submit(request(vec![1], 4)), Err(SubmitError::ShuttingDown));
}
