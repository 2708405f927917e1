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
use axiom::model::llama::LoadOptions;
use axiom::model::ModelFiles;
use axiom::parallel::{Communicator, InProcess, Rank, Shard, Tcp};
use common::hf_fixture;
use common::split::{self, Outputs, OPTIONS};
use std::path::Path;
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

/// Split, the down and output projections add each rank's partial sum where one rank adds the
/// whole row in one order: the same terms summed in another order, which moves f32 logits by a
/// few ulps of the largest terms, far below this.
const BOUND: f64 = 1e-5;

fn reference() -> CpuBackend {
    CpuBackend::reference(1)
}

/// The fast kernels, with an f32 cache so that the comparison sees the arithmetic, not f16
/// rounding a few keys the other way.
fn fast() -> CpuBackend {
    CpuBackend::new(1).with_kv_type(KvType::F32)
}

fn load(model: &Path, ranks: usize, make: fn() -> CpuBackend) -> axiom::Result<Session<CpuBackend>> {
    split::load(model, ranks, &make)
}

/// `model` split over `ranks` against it on one rank.
fn check_split(model: &Path, name: &str, ranks: usize, make: fn() -> CpuBackend, kernels: &str) {
    split::check_split(model, ranks, &make, BOUND, &format!("{name}, {kernels}"));
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

/// Each rank of a group sums its buffer over the ranks and gathers its columns: every rank must
/// hold the same bits, summed in rank order, and the columns side by side.
fn check_collectives(ranks: Vec<Box<dyn Communicator<CpuBackend>>>) {
    let (n, widths, rows) = (37, [2usize, 1, 3], 2);
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|scope| {
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                scope.spawn(move || {
                    let rank = comm.rank();
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
fn in_process_collectives_sum_in_rank_order_and_gather_columns() {
    let ranks = InProcess::group(3).unwrap();
    check_collectives(
        ranks
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator<CpuBackend>>)
            .collect(),
    );
}

/// A port on the loopback no one listens at now.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
}

/// The `size` ranks of a group over TCP on the loopback, each joined on a thread of its own.
fn tcp_group(size: usize) -> Vec<Tcp> {
    let address = free_address();
    let joins: Vec<_> = (0..size)
        .rev()
        .map(|rank| {
            let address = address.clone();
            std::thread::spawn(move || Tcp::join(&address, rank, size, Duration::from_secs(30)).unwrap())
        })
        .collect();
    let mut ranks: Vec<Tcp> = joins.into_iter().map(|j| j.join().unwrap()).collect();
    ranks.reverse();
    ranks
}

#[test]
fn tcp_collectives_sum_in_rank_order_and_gather_columns() {
    check_collectives(
        tcp_group(3)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator<CpuBackend>>)
            .collect(),
    );
}

#[test]
fn a_tcp_rank_that_stops_frees_the_others_with_its_reason() {
    // Rank 0 stopping frees a rank waiting in a collective; a rank stopping frees rank 0, which
    // tells the rest.
    for stopping in [0, 2] {
        let mut ranks = tcp_group(3);
        let stopper = ranks.remove(stopping);
        let waiting: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let mut b = reference();
                    b.reserve(256).unwrap();
                    let x = b.alloc(16).unwrap();
                    comm.all_reduce_sum(&b, x, 4).err().unwrap().to_string()
                })
            })
            .collect();
        Communicator::<CpuBackend>::abort(&stopper, "rank 2: out of pages");
        for err in waiting.into_iter().map(|w| w.join().unwrap()) {
            assert!(err.contains("rank 2: out of pages"), "{err}");
        }
    }
}

#[test]
fn tcp_ranks_must_agree_on_the_group() {
    let address = free_address();
    let first = {
        let address = address.clone();
        std::thread::spawn(move || {
            Tcp::join(&address, 0, 2, Duration::from_secs(30))
                .err()
                .unwrap()
                .to_string()
        })
    };
    let second = Tcp::join(&address, 1, 3, Duration::from_secs(30))
        .err()
        .unwrap()
        .to_string();
    let first = first.join().unwrap();
    assert!(first.contains("give every rank the same --tp-size"), "{first}");
    assert!(second.contains("give every rank the same --tp-size"), "{second}");
    let alone = Tcp::join(&free_address(), 0, 2, Duration::from_millis(200))
        .err()
        .unwrap()
        .to_string();
    assert!(alone.contains("for ranks 1 of 2, which did not connect"), "{alone}");
    let unreachable = Tcp::join(&free_address(), 1, 2, Duration::from_millis(200))
        .err()
        .unwrap()
        .to_string();
    assert!(unreachable.contains("could not reach rank 0"), "{unreachable}");
}

/// `model` loaded as each rank of a group over TCP, on threads standing for processes: rank 0
/// runs `run`, the others follow it. Rank r loads with `options(r)`.
fn over_tcp(model: &Path, size: usize, options: impl Fn(usize) -> LoadOptions) -> axiom::Result<Outputs> {
    let followers: Vec<_> = tcp_group(size)
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (model, options) = (model.to_path_buf(), options(rank));
            std::thread::spawn(move || -> axiom::Result<Option<Outputs>> {
                let rank_of = Rank {
                    backend: fast(),
                    comm: Box::new(comm),
                };
                let mut session = Session::from_files_rank(ModelFiles::open(&model)?, rank_of, options)?;
                match rank {
                    0 => Ok(Some(split::run(&mut session))),
                    _ => session.model.follow().map(|_| None),
                }
            })
        })
        .collect();
    let mut results: Vec<_> = followers.into_iter().map(|t| t.join().unwrap()).collect();
    for (rank, result) in results.iter().enumerate().skip(1) {
        if let Err(e) = result {
            return Err(axiom::Error::Backend(format!("rank {rank}: {e}")));
        }
    }
    results.swap_remove(0).map(|r| r.unwrap())
}

#[test]
fn ranks_over_tcp_give_the_logits_of_one_rank_and_refuse_ranks_loaded_otherwise() {
    let model = hf_fixture("llama");
    let whole = split::run(&mut load(&model, 1, fast).unwrap());
    split::check_alike(
        over_tcp(&model, 2, |_| OPTIONS).unwrap(),
        &whole,
        BOUND,
        "llama over 2 ranks over TCP",
    );
    let err = over_tcp(&model, 2, |rank| LoadOptions {
        max_batch: OPTIONS.max_batch + rank,
        ..OPTIONS
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("loaded another model or other options"), "{err}");
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
