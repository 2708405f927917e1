//! Model container formats and tensor element types.

pub mod fp8;
pub mod gguf;
pub mod gguf_writer;
pub mod quant;
pub mod quantize;
pub mod safetensors;
