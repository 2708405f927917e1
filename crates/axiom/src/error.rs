use crate::backend::ArenaError;
use crate::format::gguf::GgufError;

/// Everything that can go wrong in the engine, each naming the problem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("model: {0}")]
    Model(String),
    #[error("unsupported architecture {0:?} (supported: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, phi3, gemma2, gemma3_text)")]
    UnsupportedArchitecture(String),
    #[error("tensor {name:?} has type {ty}, which {op} does not support")]
    UnsupportedTensorType { name: String, ty: String, op: &'static str },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("backend: {0}")]
    Backend(String),
    #[cfg(any(target_vendor = "apple", axiom_metal_check))]
    #[error(transparent)]
    Metal(crate::backend::metal::MetalError),
    #[error("backend memory: {0}")]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    KvCacheFull(#[from] crate::model::OutOfPages),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error("prompt of {prompt} tokens plus {generate} to generate exceeds the context of {context} tokens")]
    ContextOverflow {
        prompt: usize,
        generate: usize,
        context: usize,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("constraint: {0}")]
    Constraint(#[from] crate::engine::ConstraintError),
    #[error("download: {0}")]
    Download(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }
}
