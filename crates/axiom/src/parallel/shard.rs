//! [`Shard`]: what one rank of a tensor-parallel group holds of a model, split as Megatron-LM
//! splits it. Q, K and V are split by output rows, whole heads to a rank; gate and up by output
//! rows (the feed-forward block's columns); the attention output and down projections by input
//! columns, so each rank's product is a partial sum the group adds up (`all_reduce_sum`) before
//! it joins the residual stream. The KV cache follows the KV heads. The LM head is split by
//! vocabulary rows and its logits gathered; the input embedding is replicated, since a lookup
//! costs no arithmetic and a split one would need a sum of its own.

use crate::model::ModelConfig;
use crate::{Error, Result};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    /// The rank's query heads.
    pub q_heads: Range<usize>,
    /// The KV heads its queries read: its share of them, or, with fewer KV heads than ranks, the
    /// one its queries share with the neighbouring ranks (replicated there).
    pub kv_heads: Range<usize>,
    /// The rank's columns of each feed-forward block.
    pub ffn: Range<usize>,
    /// The rank's rows of the LM head.
    pub vocab: Range<usize>,
    /// Every rank's count of LM head rows, in rank order: the widths its logits are gathered in.
    pub vocab_widths: Vec<usize>,
}

/// Rank `rank`'s part of `len` things split over `size` ranks, the parts differing by one at most.
fn part(len: usize, rank: usize, size: usize) -> Range<usize> {
    rank * len / size..(rank + 1) * len / size
}

impl Shard {
    /// All of the model, on one rank.
    pub fn whole(config: &ModelConfig) -> Shard {
        Shard {
            rank: 0,
            size: 1,
            q_heads: 0..config.n_heads,
            kv_heads: 0..config.n_kv_heads,
            ffn: 0..config.ffn_dim,
            vocab: 0..config.vocab_size,
            vocab_widths: vec![config.vocab_size],
        }
    }

    /// Rank `rank`'s share of the model over `size` ranks; a model that does not split that
    /// way is refused, naming why.
    pub fn new(config: &ModelConfig, rank: usize, size: usize) -> Result<Shard> {
        let refuse = |why: String| Err(Error::InvalidArgument(format!("--tensor-parallel {size}: {why}")));
        if size == 0 || rank >= size {
            return refuse(format!("rank {rank} of {size} ranks"));
        }
        if size == 1 {
            return Ok(Shard::whole(config));
        }
        if config.experts.is_some() {
            return refuse("mixture-of-experts models are not split across ranks yet".into());
        }
        let (heads, kv_heads) = (config.n_heads, config.n_kv_heads);
        if !heads.is_multiple_of(size) {
            return refuse(format!(
                "the model's {heads} attention heads do not divide evenly over the ranks"
            ));
        }
        let q_heads = part(heads, rank, size);
        let kv = if kv_heads.is_multiple_of(size) {
            part(kv_heads, rank, size)
        } else if kv_heads > 0 && size.is_multiple_of(kv_heads) {
            // Each KV head's queries span whole ranks: those ranks each keep a copy of it.
            let head = q_heads.start / (heads / kv_heads);
            head..head + 1
        } else {
            return refuse(format!(
                "the model's {kv_heads} KV heads neither divide evenly over the ranks nor replicate evenly on them"
            ));
        };
        if !config.ffn_dim.is_multiple_of(size) {
            return refuse(format!(
                "the feed-forward width {} does not divide evenly over the ranks",
                config.ffn_dim
            ));
        }
        if config.vocab_size < size {
            return refuse(format!("a vocabulary of {} tokens", config.vocab_size));
        }
        Ok(Shard {
            rank,
            size,
            q_heads,
            kv_heads: kv,
            ffn: part(config.ffn_dim, rank, size),
            vocab: part(config.vocab_size, rank, size),
            vocab_widths: (0..size).map(|r| part(config.vocab_size, r, size).len()).collect(),
        })
    }

    pub fn is_whole(&self) -> bool {
        self.size == 1
    }

    /// The rows of Q (and the attention output's input columns) the rank holds.
    pub fn q_rows(&self, head_dim: usize) -> Range<usize> {
        self.q_heads.start * head_dim..self.q_heads.end * head_dim
    }

    /// The rows of K and V the rank holds.
    pub fn kv_rows(&self, head_dim: usize) -> Range<usize> {
        self.kv_heads.start * head_dim..self.kv_heads.end * head_dim
    }

    /// The shape the rank computes: its heads and feed-forward width in place of the model's.
    pub fn config(&self, config: &ModelConfig) -> ModelConfig {
        ModelConfig {
            n_heads: self.q_heads.len(),
            n_kv_heads: self.kv_heads.len(),
            ffn_dim: self.ffn.len(),
            ..config.clone()
        }
    }
}
