//! Reproducible answers on the default model (fast CPU backend): a request's tokens and
//! log-probabilities do not depend on what else runs beside it, greedy or seeded, and a prompt's
//! logits do not depend, to the bit, on how its prefill was chunked or whether its prefix came
//! from the cache. The checks are in tests/common/reproducible.rs, shared with tests/cuda.rs.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use common::reproducible;

fn cpu() -> CpuBackend {
    CpuBackend::new(2)
}

#[test]
fn eight_requests_alone_and_together_give_the_same_answers() {
    reproducible::eight_requests_alone_and_together_give_the_same_answers(cpu);
}

#[test]
fn a_prompts_logits_do_not_depend_on_chunking_or_the_prefix_cache() {
    reproducible::a_prompts_logits_do_not_depend_on_chunking_or_the_prefix_cache(cpu);
}

#[test]
fn a_seeded_answer_does_not_depend_on_the_step_size_or_the_prefix_cache() {
    reproducible::a_seeded_answer_does_not_depend_on_the_step_size_or_the_prefix_cache(cpu);
}
