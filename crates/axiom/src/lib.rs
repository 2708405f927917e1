//! axiom: an inference engine for Llama-family language models.
//!
//! The path of a request: chat template ([`chat`]) → tokenizer ([`tokenizer`]) → the model's
//! forward pass ([`model`]) on a compute [`backend`] → sampler and generation loop ([`engine`]).
//! The path of a model: a source ([`source`]) → a container reader ([`format`]) →
//! [`model::config::ModelConfig`] → weights on the backend. Tool calls in the output text:
//! [`tool_calls`].

pub mod backend;
pub mod cache;
pub mod chat;
pub mod convert;
pub mod convert_fp8;
pub mod engine;
mod error;
pub mod format;
pub mod hub;
pub mod model;
pub mod parallel;
pub mod source;
pub mod tokenizer;
pub mod tool_calls;
pub mod untrusted;

pub use error::{Error, Result};
