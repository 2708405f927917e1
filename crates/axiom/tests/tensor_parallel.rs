//! Tensor parallelism on the CPU, its ranks threads of this process: every dense fixture split
//! over 2 and 4 ranks gives the logits and greedy tokens of the model on one rank, on the
//! reference and the fast backend, from safetensors and from a Q8_0 GGUF; the scheduler's
//! batched requests give their solo tokens; what cannot split is refused by name; and the
//! in-process collectives themselves.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::backend::{Kernels, KvType};
use axiom::convert::convert_hf_dir;
use axiom::engine::scheduler::{Event, Request, Scheduler, SchedulerConfig};
use axiom::engine::{SamplerConfig, Session};
use axiom::format::quant::GgmlType;
use axiom::model::llama::{GreedyDecode, LoadOptions};
use axiom::model::LogitRows;
use axiom::parallel::{Communicator, InProcess, Rank, Shard};
use common::gpu::rel_l2;
use common::hf_fixture;
use std::path::Path;
use std::sync::mpsc::channel;
use std::sync::Arc;

/// Split, the down and output projections add each rank's partial sum where one rank adds the
/// whole row in one order: the same terms summed in another order, which moves f32 logits by a
/// few ulps of the largest terms, far below this.
const BOUND: f64 = 1e-5;

/// Steps of 5 tokens, so a prompt runs in several and its last rows straddle them.
const OPTIONS: LoadOptions = LoadOptions {
    max_batch: 5,
    kv_tokens: 256,
    max_seqs: 4,
};

fn reference() -> CpuBackend {
    CpuBackend::reference(1)
}

/// The fast kernels, with an f32 cache so that the comparison sees the arithmetic, not f16
/// rounding a few keys the other way.
fn fast() -> CpuBackend {
    CpuBackend::new(1).with_kv_type(KvType::F32)
}

fn load(model: &Path, ranks: usize, make: fn() -> CpuBackend) -> axiom::Result<Session<CpuBackend>> {
    match ranks {
        1 => Session::load(model, make(), OPTIONS),
        n => Session::load_sharded(model, Rank::in_process((0..n).map(|_| make()).collect())?, OPTIONS),
    }
}

/// Every position's logits of a prompt, then 12 tokens of greedy decoding.
fn run(s: &mut Session<CpuBackend>) -> (Vec<Vec<f32>>, Vec<u32>) {
    let vocab = s.model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % vocab).collect();
    let mut kv = s.model.new_kv_cache(128);
    let mut logits = Vec::new();
    s.forward(&prompt, &mut kv, LogitRows::From(0), |_, row| logits.push(row.to_vec()))
        .unwrap();
    s.pages.free(&mut kv);
    let mut kv = s.model.new_kv_cache(128);
    let mut decode = GreedyDecode::new(&mut s.model, &mut s.pages, &mut kv, &prompt).unwrap();
    let tokens = (0..12).map(|i| decode.next_token(i < 11).unwrap()).collect();
    drop(decode);
    s.pages.free(&mut kv);
    (logits, tokens)
}

/// `model` split over `ranks` against it on one rank.
fn check_split(model: &Path, name: &str, ranks: usize, make: fn() -> CpuBackend, kernels: &str) {
    let (want_logits, want_tokens) = run(&mut load(model, 1, make).unwrap());
    let (logits, tokens) = run(&mut load(model, ranks, make).unwrap());
    assert_eq!(logits.len(), want_logits.len());
    let worst = logits
        .iter()
        .zip(&want_logits)
        .map(|(got, want)| rel_l2(got, want))
        .fold(0.0, f64::max);
    assert!(
        worst < BOUND,
        "{name} over {ranks} ranks, {kernels}: relative L2 error {worst}"
    );
    assert_eq!(
        tokens, want_tokens,
        "{name} over {ranks} ranks, {kernels}: greedy tokens"
    );
}

#[test]
fn every_dense_fixture_split_gives_its_logits_on_one_rank() {
    for &name in common::HF_FIXTURES.iter().chain(common::FP8_FIXTURES) {
        for ranks in [2, 4] {
            check_split(&hf_fixture(name), name, ranks, reference, "reference");
            check_split(&hf_fixture(name), name, ranks, fast, "fast");
        }
    }
}

#[test]
fn a_quantized_gguf_splits_at_whole_blocks_and_refuses_a_split_through_one() {
    let dir = std::env::temp_dir().join(format!("axiom-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("llama-q8_0.gguf");
    convert_hf_dir(&hf_fixture("llama"), &out, GgmlType::Q8_0, |_, _, _| {}).unwrap();
    // Over 2 ranks the output projection's columns part at 32, a whole Q8_0 block: the fast
    // backend's integer kernels run each rank's share.
    check_split(&out, "llama Q8_0", 2, fast, "fast");
    // Over 4, at 16: through a block.
    let err = load(&out, 4, fast).err().unwrap().to_string();
    assert!(
        err.contains("blk.0.attn_output.weight") && err.contains("blocks of 32"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn models_that_do_not_split_are_refused_by_name() {
    let err = |name: &str, ranks: usize| load(&hf_fixture(name), ranks, reference).err().unwrap().to_string();
    assert!(err("llama", 3).contains("4 attention heads"), "{}", err("llama", 3));
    assert!(err("llama", 8).contains("4 attention heads"), "{}", err("llama", 8));
    assert!(
        err("qwen3_moe", 2).contains("mixture-of-experts"),
        "{}",
        err("qwen3_moe", 2)
    );
    // 6 query heads over 3 ranks, 2 to a rank; 2 KV heads neither divide over 3 nor copy evenly.
    let mut config = load(&hf_fixture("llama"), 1, reference).unwrap().model.config;
    config.n_heads = 6;
    let refused = Shard::new(&config, 0, 3).err().unwrap().to_string();
    assert!(refused.contains("2 KV heads"), "{refused}");
    config.n_kv_heads = 3;
    let refused = Shard::new(&config, 0, 3).err().unwrap().to_string();
    assert!(refused.contains("feed-forward width 128"), "{refused}");
    config.ffn_dim = 96;
    assert_eq!(Shard::new(&config, 1, 3).unwrap().kv_heads, 1..2);
    assert!(load(&hf_fixture("llama"), 0, reference).is_err());
    // Ranks handed over out of their group's order.
    let mut ranks = Rank::in_process(vec![reference(), reference()]).unwrap();
    ranks.reverse();
    let err = Session::load_sharded(&hf_fixture("llama"), ranks, OPTIONS)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rank 0 of the 2 given is rank 1"), "{err}");
}

#[test]
fn fewer_kv_heads_than_ranks_are_copied_to_the_ranks_their_queries_are_on() {
    let config = load(&hf_fixture("llama"), 1, reference).unwrap().model.config;
    // 4 query heads over 2 KV heads: over 4 ranks, ranks 0 and 1 read KV head 0, 2 and 3 head 1.
    let kv: Vec<_> = (0..4).map(|r| Shard::new(&config, r, 4).unwrap().kv_heads).collect();
    assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
    let vocab: Vec<_> = (0..4).map(|r| Shard::new(&config, r, 4).unwrap().vocab).collect();
    assert_eq!(vocab, [0..250, 250..500, 500..750, 750..1000]);
}

fn greedy(prompt: Vec<u32>, events: std::sync::mpsc::Sender<Event>) -> Request {
    Request {
        prompt,
        sampling: SamplerConfig::greedy(),
        max_tokens: 10,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        constraint: None,
        logprobs: None,
        ignore_eos: true,
        sink: Box::new(events),
    }
}

/// Each prompt's greedy tokens from a scheduler over `ranks` ranks: alone, then all together.
fn scheduled(ranks: usize, prompts: &[Vec<u32>]) -> [Vec<Vec<u32>>; 2] {
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = load(&hf_fixture("llama"), ranks, fast).unwrap();
    let (mut sched, handle) = Scheduler::new(model, pages, Arc::new(tokenizer), SchedulerConfig::default());
    let tokens = |rx: std::sync::mpsc::Receiver<Event>| -> Vec<u32> {
        rx.try_iter()
            .filter_map(|e| match e {
                Event::Token(t) => Some(t.id),
                Event::Done(_) => None,
                Event::Error(e) => panic!("request failed: {e}"),
            })
            .collect()
    };
    let mut run = |batch: &[Vec<u32>]| {
        let rxs: Vec<_> = batch
            .iter()
            .map(|p| {
                let (tx, rx) = channel();
                handle.submit(greedy(p.clone(), tx)).unwrap();
                rx
            })
            .collect();
        while sched.step().unwrap() {}
        rxs.into_iter().map(tokens).collect::<Vec<_>>()
    };
    let alone = prompts.iter().flat_map(|p| run(std::slice::from_ref(p))).collect();
    [alone, run(prompts)]
}

#[test]
fn split_requests_batched_give_their_solo_tokens() {
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..3 + 4 * i).map(|j| (j * 53 + i * 7 + 1) % 1000).collect())
        .collect();
    let [alone, together] = scheduled(2, &prompts);
    assert_eq!(together, alone);
    assert!(alone.iter().all(|t| t.len() == 10), "{alone:?}");
    let [one_rank, _] = scheduled(1, &prompts);
    assert_eq!(alone, one_rank);
}

/// Rank r's buffer of `n` values, each rank's different.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 13) % 11) as f32 * 0.1 - 0.3 + rank as f32 * 1e-7)
        .collect()
}

#[test]
fn in_process_collectives_sum_in_rank_order_and_gather_columns() {
    let (n, widths, rows) = (37, [2usize, 1, 3], 2);
    let ranks = InProcess::group(3).unwrap();
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|scope| {
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                scope.spawn(move || {
                    let rank = Communicator::<CpuBackend>::rank(&comm);
                    let mut b = reference();
                    b.reserve(4096).unwrap();
                    let (x, part, out) = (b.alloc(n * 4).unwrap(), b.alloc(64).unwrap(), b.alloc(64).unwrap());
                    b.write_f32(x, &values(rank, n)).unwrap();
                    comm.all_reduce_sum(&b, x, n).unwrap();
                    let mine: Vec<f32> = (0..rows * widths[rank]).map(|i| (rank * 10 + i) as f32).collect();
                    b.write_f32(part, &mine).unwrap();
                    comm.all_gather(&b, part, out, rows, &widths).unwrap();
                    let (mut sum, mut gathered) = (vec![0.0; n], vec![0.0; rows * 6]);
                    b.read_f32(x, &mut sum).unwrap();
                    b.read_f32(out, &mut gathered).unwrap();
                    (sum, gathered)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..n)
        .map(|i| values(0, n)[i] + values(1, n)[i] + values(2, n)[i])
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (sum, gathered) in &results {
        assert_eq!(bits(sum), bits(&want));
        assert_eq!(gathered, &[0., 1., 10., 20., 21., 22., 2., 3., 11., 23., 24., 25.]);
    }
}

#[test]
fn a_rank_that_stops_frees_the_others_with_its_reason() {
    let mut ranks = InProcess::group(2).unwrap();
    let second = ranks.pop().unwrap();
    let first = ranks.pop().unwrap();
    let waiting = std::thread::spawn(move || {
        let mut b = reference();
        b.reserve(256).unwrap();
        let x = b.alloc(16).unwrap();
        second.all_reduce_sum(&b, x, 4).err().unwrap().to_string()
    });
    Communicator::<CpuBackend>::abort(&first, "rank 0: out of pages");
    let err = waiting.join().unwrap();
    assert!(err.contains("rank 0: out of pages"), "{err}");
}
