//! Loading a model's tensors onto a backend, checking each against the config.

use super::config::ModelConfig;
use crate::backend::{Backend, BlockHandle, HostTensor};
use crate::format::gguf::{GgufFile, TensorInfo};
use crate::format::quant::dequantize;
use crate::{Error, Result};

pub struct LayerWeights<W> {
    pub attn_norm: BlockHandle,
    pub wq: W,
    pub wk: W,
    pub wv: W,
    pub wo: W,
    pub ffn_norm: BlockHandle,
    pub w_gate: W,
    pub w_up: W,
    pub w_down: W,
}

pub struct Weights<W> {
    pub token_embd: W,
    pub output_norm: BlockHandle,
    /// The LM head; `None` when it is tied to the token embedding.
    pub output: Option<W>,
    pub layers: Vec<LayerWeights<W>>,
}

impl<W> Weights<W> {
    pub fn lm_head(&self) -> &W {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

/// The largest matrix (elements) and the widest matmul input of the model.
pub fn largest(config: &ModelConfig) -> (usize, usize) {
    let a = config.attention();
    let widest = config.dim.max(config.ffn_dim).max(a.q_width());
    let largest = [
        config.vocab_size * config.dim,
        config.ffn_dim * config.dim,
        a.q_width() * config.dim,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    (largest, widest)
}

/// Bytes of arena the norm vectors need (they are uploaded as f32 blocks).
pub fn norm_bytes(config: &ModelConfig) -> usize {
    (2 * config.n_layers + 1) * config.dim.next_multiple_of(16) * 4
}

struct Loader<'a, B: Backend> {
    file: &'a GgufFile,
    backend: &'a mut B,
}

impl<B: Backend> Loader<'_, B> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.file
            .tensor(name)
            .ok_or_else(|| Error::Model(format!("missing tensor {name}")))
    }

    fn check_dims(info: &TensorInfo, expected: &[usize]) -> Result<()> {
        if info.dims != expected {
            return Err(Error::Model(format!(
                "tensor {} has shape {:?}, expected {:?}",
                info.name, info.dims, expected
            )));
        }
        Ok(())
    }

    /// A matrix with `n_out` rows of `n_in`, kept in its stored type.
    fn matrix(&mut self, name: &str, n_in: usize, n_out: usize) -> Result<B::Weight> {
        let info = self.info(name)?.clone();
        Self::check_dims(&info, &[n_in, n_out])?;
        let tensor = HostTensor {
            name,
            ty: info.ty,
            dims: &info.dims,
            bytes: self.file.tensor_bytes(&info),
            region: Some(self.file.tensor_region(&info)),
        };
        self.backend.upload_weight(&tensor)
    }

    /// A vector, converted to f32 and copied into the arena.
    fn vector(&mut self, name: &str, len: usize) -> Result<BlockHandle> {
        let info = self.info(name)?.clone();
        Self::check_dims(&info, &[len])?;
        let mut values = vec![0f32; len];
        dequantize(info.ty, self.file.tensor_bytes(&info), &mut values);
        let block = self.backend.alloc(len * 4)?;
        self.backend.write_f32(block, &values)?;
        Ok(block)
    }
}

pub fn load_gguf<B: Backend>(file: &GgufFile, config: &ModelConfig, backend: &mut B) -> Result<Weights<B::Weight>> {
    let (dim, ffn, vocab) = (config.dim, config.ffn_dim, config.vocab_size);
    let (qw, kvw) = (config.attention().q_width(), config.attention().kv_width());
    let mut l = Loader { file, backend };
    let token_embd = l.matrix("token_embd.weight", dim, vocab)?;
    let output_norm = l.vector("output_norm.weight", dim)?;
    let output = match file.tensor("output.weight") {
        Some(_) => Some(l.matrix("output.weight", dim, vocab)?),
        None => None,
    };
    let mut layers = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        layers.push(LayerWeights {
            attn_norm: l.vector(&p("attn_norm"), dim)?,
            wq: l.matrix(&p("attn_q"), dim, qw)?,
            wk: l.matrix(&p("attn_k"), dim, kvw)?,
            wv: l.matrix(&p("attn_v"), dim, kvw)?,
            wo: l.matrix(&p("attn_output"), qw, dim)?,
            ffn_norm: l.vector(&p("ffn_norm"), dim)?,
            w_gate: l.matrix(&p("ffn_gate"), dim, ffn)?,
            w_up: l.matrix(&p("ffn_up"), dim, ffn)?,
            w_down: l.matrix(&p("ffn_down"), ffn, dim)?,
        });
    }
    Ok(Weights {
        token_embd,
        output_norm,
        output,
        layers,
    })
}
