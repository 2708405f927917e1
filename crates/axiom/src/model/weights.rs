//! Loading a model's tensors onto a backend, checking each against the config. Tensors are asked
//! for by their GGUF names; a Hugging Face checkpoint maps those to its own.

use super::config::ModelConfig;
use super::experts_config::ExpertsConfig;
use super::rope_config::{LONGROPE_LONG, LONGROPE_SHORT};
use crate::backend::{Backend, BlockHandle, HostTensor};
use crate::format::gguf::GgufFile;
use crate::format::quant::{dequantize, GgmlType};
use crate::format::safetensors::SafetensorsModel;
use crate::parallel::Shard;
use crate::{Error, Result};
use std::collections::HashSet;
use std::ops::Range;

pub struct LayerWeights<W> {
    pub attn_norm: BlockHandle,
    pub wq: W,
    pub wk: W,
    pub wv: W,
    pub wo: W,
    /// Q, K, V biases (Qwen2; Llama and Qwen3 with `attention_bias`).
    pub qkv_bias: Option<[BlockHandle; 3]>,
    /// The output projection's bias (Llama and Qwen3 with `attention_bias`).
    pub o_bias: Option<BlockHandle>,
    /// Per-head Q and K norms (Qwen3).
    pub qk_norm: Option<[BlockHandle; 2]>,
    pub ffn_norm: BlockHandle,
    /// The norms of the attention and feed-forward outputs (Gemma 2 and 3).
    pub post_norms: Option<[BlockHandle; 2]>,
    pub ffn: FeedForwardWeights<W>,
}

/// A layer's feed-forward block: one gated block, or a mixture of experts.
pub enum FeedForwardWeights<W> {
    Dense { gate: W, up: W, down: W },
    Mixture(MixtureWeights<W>),
}

/// A mixture-of-experts block: the router (`[n_experts, dim]`), each expert's three matrices,
/// and the shared expert where the model has one.
pub struct MixtureWeights<W> {
    pub router: W,
    pub gate: Vec<W>,
    pub up: Vec<W>,
    pub down: Vec<W>,
    pub shared: Option<SharedExpertWeights<W>>,
}

/// Qwen2-MoE's shared expert: a gated block and the `[1, dim]` matrix of its sigmoid gate.
pub struct SharedExpertWeights<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
    pub gate_inp: W,
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

/// Where tensors come from: a GGUF file or a Hugging Face checkpoint.
pub trait TensorSource {
    /// The tensor stored under GGUF name `name` ("blk.0.attn_q.weight"), if there is one.
    fn tensor(&self, name: &str) -> Option<HostTensor<'_>>;
    /// Every tensor: (type, dimensions, bytes), for sizing and summaries; in the order of
    /// `stored_names`.
    fn all(&self) -> Vec<(GgmlType, Vec<usize>, usize)>;
    /// Every tensor's name as the file stores it (a [`HostTensor`]'s `name`).
    fn stored_names(&self) -> Vec<&str>;
}

impl TensorSource for GgufFile {
    fn tensor(&self, name: &str) -> Option<HostTensor<'_>> {
        let info = GgufFile::tensor(self, name)?;
        Some(HostTensor {
            name: &info.name,
            ty: info.ty,
            dims: &info.dims,
            bytes: self.tensor_bytes(info),
            region: Some(self.tensor_region(info)),
        })
    }

    fn all(&self) -> Vec<(GgmlType, Vec<usize>, usize)> {
        self.tensors
            .iter()
            .map(|t| (t.ty, t.dims.clone(), t.size_bytes))
            .collect()
    }

    fn stored_names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }
}

/// How a checkpoint names its layers' parts where families differ.
#[derive(Debug, Clone, Copy)]
struct HfNaming {
    /// The feed-forward input norm is `pre_feedforward_layernorm` (Gemma's four norms a layer).
    four_norms: bool,
    /// The experts live in `block_sparse_moe` with matrices `w1`, `w3`, `w2` (Mixtral), not in
    /// `mlp` as `gate_proj`, `up_proj`, `down_proj` (Qwen).
    mixtral: bool,
}

/// The Hugging Face name of a GGUF tensor name. One expert's matrix of a stacked GGUF expert
/// tensor is asked for as `blk.N.ffn_gate_exps.E.weight` (expert E).
fn hf_name(gguf: &str, naming: HfNaming) -> Option<String> {
    let four_norms = naming.four_norms;
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, field) = rest.split_once('.')?;
            let (field, kind) = field.rsplit_once('.')?;
            if let Some((stacked, expert)) = field.split_once('.') {
                let proj = match (stacked, naming.mixtral) {
                    ("ffn_gate_exps", false) => "gate_proj",
                    ("ffn_up_exps", false) => "up_proj",
                    ("ffn_down_exps", false) => "down_proj",
                    ("ffn_gate_exps", true) => "w1",
                    ("ffn_up_exps", true) => "w3",
                    ("ffn_down_exps", true) => "w2",
                    _ => return None,
                };
                let block = if naming.mixtral { "block_sparse_moe" } else { "mlp" };
                return Some(format!("model.layers.{layer}.{block}.experts.{expert}.{proj}.{kind}"));
            }
            let hf = match field {
                "ffn_gate_inp" if naming.mixtral => "block_sparse_moe.gate",
                "ffn_gate_inp" => "mlp.gate",
                "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
                "ffn_up_shexp" => "mlp.shared_expert.up_proj",
                "ffn_down_shexp" => "mlp.shared_expert.down_proj",
                "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
                "attn_norm" => "input_layernorm",
                "ffn_norm" if four_norms => "pre_feedforward_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "post_attention_norm" if four_norms => "post_attention_layernorm",
                "post_ffw_norm" if four_norms => "post_feedforward_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_qkv" => "self_attn.qkv_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_gate_up" => "mlp.gate_up_proj",
                "ffn_down" => "mlp.down_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}.{kind}")
        }
    })
}

impl TensorSource for SafetensorsModel {
    fn tensor(&self, name: &str) -> Option<HostTensor<'_>> {
        // Gemma's `post_attention_layernorm` follows attention; other models' is the FFN's input.
        let naming = HfNaming {
            four_norms: self.get("model.layers.0.pre_feedforward_layernorm.weight").is_some(),
            mixtral: self.get("model.layers.0.block_sparse_moe.gate.weight").is_some(),
        };
        let hf = hf_name(name, naming)?;
        let entry = self.get(&hf)?;
        Some(HostTensor {
            name: &entry.name,
            ty: entry.ty,
            dims: &entry.dims,
            bytes: self.bytes(entry),
            region: Some(self.region(entry)),
        })
    }

    fn all(&self) -> Vec<(GgmlType, Vec<usize>, usize)> {
        self.names()
            .map(|(_, e)| (e.ty, e.dims.clone(), self.bytes(e).len()))
            .collect()
    }

    fn stored_names(&self) -> Vec<&str> {
        self.names().map(|(name, _)| name.as_str()).collect()
    }
}

/// The one kind of tensor a file may carry that nothing reads, by name suffix: the rotary
/// frequencies older transformers saved as buffers, which axiom computes from the config.
const NOT_READ: &[&str] = &[".rotary_emb.inv_freq"];

/// Refuses a file with a tensor nothing read (by the stored names in `read`): running without
/// it would compute a different model than the file's.
pub fn refuse_unread<S: TensorSource + ?Sized>(source: &S, read: &HashSet<&str>) -> Result<()> {
    let mut unread: Vec<&str> = source
        .stored_names()
        .into_iter()
        .filter(|name| !read.contains(name) && !NOT_READ.iter().any(|suffix| name.ends_with(suffix)))
        .collect();
    if unread.is_empty() {
        return Ok(());
    }
    unread.sort_unstable();
    let shown = unread.len().min(4);
    let more = match unread.len() - shown {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    Err(Error::Model(format!(
        "the file carries tensors its config does not use: {}{more} (running without them would compute another model)",
        unread[..shown].join(", ")
    )))
}

/// The largest matrix (elements) and the widest matmul input of the model.
pub fn largest(config: &ModelConfig) -> (usize, usize) {
    let a = config.attention();
    // An expert's, a shared expert's width, and the router's count of experts.
    let [expert, shared, router] = config
        .experts
        .as_ref()
        .map_or([0; 3], |e| [e.ffn_dim, e.shared_ffn_dim.unwrap_or(0), e.count]);
    let widest = config.dim.max(config.ffn_dim).max(a.q_width()).max(expert).max(shared);
    let largest = [
        config.vocab_size * config.dim,
        config.ffn_dim.max(expert).max(shared).max(router) * config.dim,
        a.q_width() * config.dim,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    (largest, widest)
}

/// Bytes of arena the vectors (norms, biases, rope frequencies) need as f32 blocks.
pub fn vector_bytes(config: &ModelConfig) -> usize {
    let a = config.attention();
    let per_layer = 5 * config.dim + a.q_width() + 2 * a.kv_width() + 2 * config.head_dim;
    ((config.n_layers * per_layer + config.dim + 2 * config.head_dim) * 4).next_multiple_of(64)
        + (config.n_layers * 11 + 3) * 256
}

struct Loader<'a, B: Backend, S: TensorSource + ?Sized> {
    source: &'a S,
    backend: &'a mut B,
    /// The stored names of the tensors read so far.
    read: HashSet<&'a str>,
    norm_offset: f32,
}

/// One matrix of every expert, `[n_in, n_out]` each: the slices of the stacked GGUF tensor
/// `{name}.weight` (`[n_in, n_out, count]`), or a checkpoint's `{name}.E.weight` per expert E.
pub fn expert_tensors<'s, S: TensorSource + ?Sized>(
    source: &'s S,
    name: &str,
    count: usize,
    [n_in, n_out]: [usize; 2],
) -> Result<Vec<HostTensor<'s>>> {
    let Some(t) = source.tensor(&format!("{name}.weight")) else {
        if source.tensor(&format!("{name}.0.weight")).is_none() {
            return Err(Error::Model(format!(
                "missing tensor {name}.weight (each expert's {n_out} x {n_in} matrix, stacked)"
            )));
        }
        return (0..count)
            .map(|e| checked(source, &format!("{name}.{e}.weight"), &[n_in, n_out]))
            .collect();
    };
    let per_expert = t.ty.row_bytes(n_in) * n_out;
    if t.dims != [n_in, n_out, count] || t.bytes.len() != per_expert * count {
        return Err(Error::Model(format!(
            "tensor {}.weight has shape {:?}, expected {:?}",
            name,
            t.dims,
            [n_in, n_out, count]
        )));
    }
    let dims = &t.dims[..2];
    Ok((0..count)
        .map(|e| {
            let bytes = e * per_expert..(e + 1) * per_expert;
            HostTensor {
                name: t.name,
                ty: t.ty,
                dims,
                bytes: &t.bytes[bytes.clone()],
                region: t
                    .region
                    .clone()
                    .map(|(map, r)| (map, r.start + bytes.start..r.start + bytes.end)),
            }
        })
        .collect())
}

/// The tensor `name`, checked to have the dimensions `expected`.
fn checked<'s, S: TensorSource + ?Sized>(source: &'s S, name: &str, expected: &[usize]) -> Result<HostTensor<'s>> {
    let t = source
        .tensor(name)
        .ok_or_else(|| Error::Model(format!("missing tensor {name}")))?;
    if t.dims != expected {
        return Err(Error::Model(format!(
            "tensor {name} has shape {:?}, expected {:?}",
            t.dims, expected
        )));
    }
    Ok(t)
}

impl<'a, B: Backend, S: TensorSource + ?Sized> Loader<'a, B, S> {
    /// The tensor `name`, checked to have the dimensions `expected`, counted as read.
    fn take(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor<'a>> {
        let t = checked(self.source, name, expected)?;
        self.read.insert(t.name);
        Ok(t)
    }

    /// A matrix with `n_out` rows of `n_in`, kept in its stored type.
    fn matrix(&mut self, name: &str, n_in: usize, n_out: usize) -> Result<B::Weight> {
        let tensor = self.take(name, &[n_in, n_out])?;
        self.backend.upload_weight(&tensor)
    }

    /// Rows `keep` of a matrix with `n_out` rows of `n_in`: a rank's share of a matrix split by
    /// its outputs.
    fn rows(&mut self, name: &str, n_in: usize, n_out: usize, keep: Range<usize>) -> Result<B::Weight> {
        let [matrix] = self.split(name, n_in, [n_out], [keep])?;
        Ok(matrix)
    }

    /// Columns `keep` of a matrix with `n_out` rows of `n_in`: a rank's share of a matrix split
    /// by its inputs, copied out of every row, which must part at whole blocks of its type.
    fn columns(&mut self, name: &str, n_in: usize, n_out: usize, keep: Range<usize>) -> Result<B::Weight> {
        let t = self.take(name, &[n_in, n_out])?;
        if keep == (0..n_in) {
            return self.backend.upload_weight(&t);
        }
        let block = t.ty.block_len();
        if !keep.start.is_multiple_of(block) || !keep.end.is_multiple_of(block) {
            return Err(Error::Model(format!(
                "tensor {name} cannot be split across ranks at columns {keep:?}: its type {} stores blocks of {block}",
                t.ty
            )));
        }
        let (row, from, to) = (
            t.ty.row_bytes(n_in),
            t.ty.row_bytes(keep.start),
            t.ty.row_bytes(keep.end),
        );
        let bytes: Vec<u8> = t.bytes.chunks_exact(row).flat_map(|r| &r[from..to]).copied().collect();
        let dims = [keep.len(), n_out];
        self.backend.upload_weight(&HostTensor {
            name: t.name,
            ty: t.ty,
            dims: &dims,
            bytes: &bytes,
            region: None,
        })
    }

    /// A vector, converted to f32 and copied into the arena.
    fn vector(&mut self, name: &str, len: usize) -> Result<BlockHandle> {
        self.vector_plus(name, len, 0.0, 0..len)
    }

    /// Elements `keep` of a vector of `len` (a rank's share of a bias split with its matrix).
    fn vector_part(&mut self, name: &str, len: usize, keep: Range<usize>) -> Result<BlockHandle> {
        self.vector_plus(name, len, 0.0, keep)
    }

    /// A norm's weights, with the offset the file stores them minus.
    fn norm(&mut self, name: &str, len: usize) -> Result<BlockHandle> {
        self.vector_plus(name, len, self.norm_offset, 0..len)
    }

    fn vector_plus(&mut self, name: &str, len: usize, offset: f32, keep: Range<usize>) -> Result<BlockHandle> {
        let t = self.take(name, &[len])?;
        let mut values = vec![0f32; len];
        dequantize(t.ty, t.bytes, &mut values);
        values.iter_mut().for_each(|v| *v += offset);
        self.upload(&values[keep])
    }

    /// Matrices of `parts` rows of `n_in` each, in that order, from the one stored matrix `name`
    /// that holds them all (Phi-3's fused projections), each cut to its rows `keep` (a rank's
    /// share): each is a run of whole rows.
    fn split<const N: usize>(
        &mut self,
        name: &str,
        n_in: usize,
        parts: [usize; N],
        keep: [Range<usize>; N],
    ) -> Result<[B::Weight; N]> {
        let tensor = self.take(name, &[n_in, parts.iter().sum()])?;
        let row_bytes = tensor.bytes.len() / parts.iter().sum::<usize>().max(1);
        let mut first = 0;
        let mut matrices = Vec::with_capacity(N);
        for (rows, keep) in parts.into_iter().zip(keep) {
            let bytes = (first + keep.start) * row_bytes..(first + keep.end) * row_bytes;
            let region = tensor
                .region
                .clone()
                .map(|(map, r)| (map, r.start + bytes.start..r.start + bytes.end));
            let dims = [n_in, keep.len()];
            let part = HostTensor {
                name: tensor.name,
                ty: tensor.ty,
                dims: &dims,
                bytes: &tensor.bytes[bytes],
                region,
            };
            matrices.push(self.backend.upload_weight(&part)?);
            first += rows;
        }
        matrices
            .try_into()
            .map_err(|_| Error::Model(format!("{name}: split into the wrong number of parts")))
    }

    /// One matrix of every expert (see `expert_tensors`), counted as read.
    fn experts(&mut self, name: &str, count: usize, shape: [usize; 2]) -> Result<Vec<B::Weight>> {
        let tensors = expert_tensors(self.source, name, count, shape)?;
        self.read.extend(tensors.iter().map(|t| t.name));
        self.backend.upload_experts(&tensors)
    }

    /// A matrix of one row, stored as a `[1, n_in]` matrix or as a vector (GGUF).
    fn row(&mut self, name: &str, n_in: usize) -> Result<B::Weight> {
        let tensor = match self.source.tensor(name) {
            Some(t) if t.dims == [n_in] => t,
            _ => checked(self.source, name, &[n_in, 1])?,
        };
        self.read.insert(tensor.name);
        self.backend.upload_weight(&tensor)
    }

    /// Layer `i`'s mixture-of-experts block.
    fn mixture(
        &mut self,
        i: usize,
        config: &ModelConfig,
        experts: &ExpertsConfig,
    ) -> Result<MixtureWeights<B::Weight>> {
        let p = |s: &str| format!("blk.{i}.{s}");
        let (dim, width, count) = (config.dim, experts.ffn_dim, experts.count);
        let shared = match experts.shared_ffn_dim {
            Some(w) => Some(SharedExpertWeights {
                gate: self.matrix(&p("ffn_gate_shexp.weight"), dim, w)?,
                up: self.matrix(&p("ffn_up_shexp.weight"), dim, w)?,
                down: self.matrix(&p("ffn_down_shexp.weight"), w, dim)?,
                gate_inp: self.row(&p("ffn_gate_inp_shexp.weight"), dim)?,
            }),
            None => None,
        };
        Ok(MixtureWeights {
            router: self.matrix(&p("ffn_gate_inp.weight"), dim, count)?,
            gate: self.experts(&p("ffn_gate_exps"), count, [dim, width])?,
            up: self.experts(&p("ffn_up_exps"), count, [dim, width])?,
            down: self.experts(&p("ffn_down_exps"), count, [width, dim])?,
            shared,
        })
    }

    fn upload(&mut self, values: &[f32]) -> Result<BlockHandle> {
        let block = self.backend.alloc(values.len() * 4)?;
        self.backend.write_f32(block, values)?;
        Ok(block)
    }
}

/// The rope kernels' frequency tables: every layer's, or the sliding layers' own where their
/// rope differs.
#[derive(Debug, Clone, Copy)]
pub struct RopeTables {
    pub global: BlockHandle,
    pub local: Option<BlockHandle>,
}

/// Uploads every weight the config calls for, of them `shard`'s share; also the rope frequency
/// tables, for sequences of up to `longest_sequence` tokens. A tensor in `source` that the
/// config does not call for is an error naming it.
pub fn load<B: Backend, S: TensorSource + ?Sized>(
    source: &S,
    config: &ModelConfig,
    shard: &Shard,
    backend: &mut B,
    longest_sequence: usize,
) -> Result<(Weights<B::Weight>, RopeTables)> {
    let (dim, ffn, vocab) = (config.dim, config.ffn_dim, config.vocab_size);
    let (qw, kvw, hd) = (
        config.attention().q_width(),
        config.attention().kv_width(),
        config.head_dim,
    );
    let mut l = Loader {
        source,
        backend,
        read: HashSet::new(),
        norm_offset: config.norm_weight_offset,
    };
    // GGUF's per-pair rope divisors were read into the config.
    if let (Some(_), Some(t)) = (&config.rope_factors, source.tensor("rope_freqs.weight")) {
        l.read.insert(t.name);
    }
    // So were LongRoPE's.
    if config.longrope.is_some() {
        for name in [LONGROPE_SHORT, LONGROPE_LONG] {
            if let Some(t) = source.tensor(name) {
                l.read.insert(t.name);
            }
        }
    }
    let (q_rows, kv_rows, ffn_cols) = (shard.q_rows(hd), shard.kv_rows(hd), shard.ffn.clone());
    let token_embd = l.matrix("token_embd.weight", dim, vocab)?;
    let output_norm = l.norm("output_norm.weight", dim)?;
    // A tied head split across ranks is the rank's rows of the embedding, as a matrix of its own.
    let output = match source.tensor("output.weight") {
        Some(_) => Some(l.rows("output.weight", dim, vocab, shard.vocab.clone())?),
        None if !shard.is_whole() => Some(l.rows("token_embd.weight", dim, vocab, shard.vocab.clone())?),
        None => None,
    };
    let mut layers = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}");
        let qkv_bias = match config.qkv_bias {
            true => Some([
                l.vector_part(&p("attn_q.bias"), qw, q_rows.clone())?,
                l.vector_part(&p("attn_k.bias"), kvw, kv_rows.clone())?,
                l.vector_part(&p("attn_v.bias"), kvw, kv_rows.clone())?,
            ]),
            false => None,
        };
        let qk_norm = match config.qk_norm {
            true => Some([
                l.norm(&p("attn_q_norm.weight"), hd)?,
                l.norm(&p("attn_k_norm.weight"), hd)?,
            ]),
            false => None,
        };
        let o_bias = match config.o_bias {
            true => Some(l.vector(&p("attn_output.bias"), dim)?),
            false => None,
        };
        let post_norms = match config.post_norms {
            true => Some([
                l.norm(&p("post_attention_norm.weight"), dim)?,
                l.norm(&p("post_ffw_norm.weight"), dim)?,
            ]),
            false => None,
        };
        // Phi-3 stores Q, K and V as one matrix, and gate and up as one (llama.cpp's GGUF names
        // it `ffn_up`); they are split into the separate matrices every backend runs.
        let [wq, wk, wv] = match source.tensor(&p("attn_qkv.weight")) {
            Some(_) => l.split(
                &p("attn_qkv.weight"),
                dim,
                [qw, kvw, kvw],
                [q_rows.clone(), kv_rows.clone(), kv_rows.clone()],
            )?,
            None => [
                l.rows(&p("attn_q.weight"), dim, qw, q_rows.clone())?,
                l.rows(&p("attn_k.weight"), dim, kvw, kv_rows.clone())?,
                l.rows(&p("attn_v.weight"), dim, kvw, kv_rows.clone())?,
            ],
        };
        let fused_gate_up = match source.tensor(&p("ffn_gate_up.weight")) {
            Some(_) => Some(p("ffn_gate_up.weight")),
            None if config.architecture == "phi3" => Some(p("ffn_up.weight")),
            None => None,
        };
        let ffn = match &config.experts {
            Some(experts) if experts.is_mixture(i) => FeedForwardWeights::Mixture(l.mixture(i, config, experts)?),
            _ => {
                let [gate, up] = match fused_gate_up {
                    Some(name) => l.split(&name, dim, [ffn, ffn], [ffn_cols.clone(), ffn_cols.clone()])?,
                    None => [
                        l.rows(&p("ffn_gate.weight"), dim, ffn, ffn_cols.clone())?,
                        l.rows(&p("ffn_up.weight"), dim, ffn, ffn_cols.clone())?,
                    ],
                };
                let down = l.columns(&p("ffn_down.weight"), ffn, dim, ffn_cols.clone())?;
                FeedForwardWeights::Dense { gate, up, down }
            }
        };
        layers.push(LayerWeights {
            attn_norm: l.norm(&p("attn_norm.weight"), dim)?,
            wq,
            wk,
            wv,
            wo: l.columns(&p("attn_output.weight"), qw, dim, q_rows.clone())?,
            qkv_bias,
            o_bias,
            qk_norm,
            ffn_norm: l.norm(&p("ffn_norm.weight"), dim)?,
            post_norms,
            ffn,
        });
    }
    refuse_unread(source, &l.read)?;
    let freqs = RopeTables {
        global: l.upload(&config.rope_frequencies(longest_sequence))?,
        local: match config.local_rope() {
            Some(rope) => Some(l.upload(&rope.inverse_frequencies())?),
            None => None,
        },
    };
    Ok((
        Weights {
            token_embd,
            output_norm,
            output,
            layers,
        },
        freqs,
    ))
}
