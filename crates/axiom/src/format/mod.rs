//! Model container formats and tensor element types.

pub mod gguf;
pub mod quant;
pub mod safetensors;
