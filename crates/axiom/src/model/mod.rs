//! The model: normalized hyperparameters, weights, and the Llama forward pass.

pub mod config;
pub mod llama;
pub mod weights;

pub use config::ModelConfig;
pub use llama::{KvCache, Llama, LogitRows};
