//! The model: the files it is read from, normalized hyperparameters, weights, and the Llama forward pass.

pub mod config;
pub mod experts_config;
pub mod files;
pub mod kv_cache;
pub mod llama;
pub mod quantization;
pub mod rope_config;
pub mod weights;

pub use config::ModelConfig;
pub use experts_config::ExpertsConfig;
pub use files::ModelFiles;
pub use kv_cache::{KvCache, OutOfPages, PagePool, PageUsage};
pub use llama::{GreedyDecode, Llama, LoadOptions, LogitRows, SeqStep, StepOutput, StepSink, Want, PAGE_SIZE};
