//! Turning logits into text: sampling, the generation loop, and perplexity.

pub mod bench;
pub mod conversation;
pub mod generate;
pub mod output;
pub mod perplexity;
pub mod sampler;
pub mod scheduler;
pub mod session;

pub use generate::{generate, GenerateOptions, Generation};
pub use output::StopReason;
pub use sampler::{Sampler, SamplerConfig, SamplingError, SamplingField};
pub use session::Session;
