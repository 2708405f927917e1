//! A model split over ranks against it on one rank, on any backend: every position's logits of
//! a prompt run in several steps, and greedy tokens (tests/tensor_parallel.rs on the CPU,
//! tests/cuda.rs on a GPU).

use axiom::backend::Backend;
use axiom::engine::Session;
use axiom::model::llama::{GreedyDecode, Llama, LoadOptions};
use axiom::model::LogitRows;
use axiom::parallel::Rank;
use std::path::Path;

/// Steps of 5 tokens, so a prompt runs in several and its last rows straddle them.
pub const OPTIONS: LoadOptions = LoadOptions {
    max_batch: 5,
    kv_tokens: 256,
    max_seqs: 4,
};

/// `model` on one backend from `make`, or split over `ranks` of them in one process.
pub fn load<B: Backend + 'static>(model: &Path, ranks: usize, make: &impl Fn() -> B) -> axiom::Result<Session<B>>
where
    Llama<B>: Send,
{
    match ranks {
        1 => Session::load(model, make(), OPTIONS),
        n => Session::load_sharded(model, Rank::in_process((0..n).map(|_| make()).collect())?, OPTIONS),
    }
}

/// Every position's logits of a prompt, and greedy tokens after it.
pub type Outputs = (Vec<Vec<f32>>, Vec<u32>);

/// Every position's logits of a prompt, then 12 tokens of greedy decoding.
pub fn run<B: Backend>(s: &mut Session<B>) -> Outputs {
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

/// `split`'s logits within `bound` (relative L2, the worst row) of `whole`'s, and its greedy
/// tokens the same.
pub fn check_alike(split: Outputs, whole: &Outputs, bound: f64, what: &str) {
    let (logits, tokens) = split;
    assert_eq!(logits.len(), whole.0.len());
    let worst = logits
        .iter()
        .zip(&whole.0)
        .map(|(got, want)| super::gpu::rel_l2(got, want))
        .fold(0.0, f64::max);
    assert!(worst < bound, "{what}: relative L2 error {worst}");
    assert_eq!(tokens, whole.1, "{what}: greedy tokens");
}

/// `model` split over `ranks` in one process against it on one rank.
pub fn check_split<B: Backend + 'static>(model: &Path, ranks: usize, make: &impl Fn() -> B, bound: f64, what: &str)
where
    Llama<B>: Send,
{
    let whole = run(&mut load(model, 1, make).unwrap());
    check_alike(
        run(&mut load(model, ranks, make).unwrap()),
        &whole,
        bound,
        &format!("{what} over {ranks} ranks"),
    );
}
