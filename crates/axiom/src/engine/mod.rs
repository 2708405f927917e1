//! Turning logits into text: sampling, the generation loop, and perplexity.

pub mod bench;
pub mod constraint;
pub mod conversation;
mod gbnf;
pub mod generate;
pub mod output;
pub mod perplexity;
pub mod sampler;
pub mod scheduler;
pub mod session;
mod token_env;
pub mod tool_choice;

pub use constraint::{ConstraintError, ConstraintSpec};
pub use generate::{generate, GenerateOptions, Generation};
pub use output::StopReason;
pub use sampler::{Sampler, SamplerConfig, SamplingError, SamplingField};
pub use session::Session;
