//! Writes of a step's keys and values into the paged KV cache: as they are (kernels/kv_write.cu),
//! or rotated on the way (kernels/rope_kv_write.cu).

use super::flash_attention::FLASH_MIN_TOKENS;
use super::launch::page_size_arg;
use super::params::{KvWriteParams, RopeKvWriteParams};
use super::rope::rope_args;
use super::{CudaBackend, FlashPlan};
use crate::backend::{AttentionKv, AttentionShape, BlockHandle, NewRows, PagedKv};
use crate::Result;

/// Heads per block of rope_kv_write.cu in steps of few tokens, so that a decode step's heads
/// spread over blocks (one pair a thread); steps of `FLASH_MIN_TOKENS` or more take each token's
/// heads in one block, which computes their angles once for all of them.
const ROPE_HEADS: usize = 4;

impl CudaBackend {
    /// `Kernels::kv_write`.
    pub(super) fn launch_kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        pages: PagedKv,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()> {
        self.launch(
            &format!("kv_write_{}", self.kv_suffix()),
            (n_tokens as u32, 1, 1),
            256,
            &KvWriteParams {
                k: self.ptr(k),
                v: self.ptr(v),
                k_cache: self.ptr(k_cache),
                v_cache: self.ptr(v_cache),
                positions: self.ptr(positions),
                tables: self.ptr(pages.block_tables),
                table_width: pages.table_width as i32,
                token_seqs: self.ptr(pages.token_seqs),
                page_size: page_size_arg(&pages)?,
                width: kv_width as i32,
            },
        )
    }

    /// `rope_kv_write`; with `turns` (a flash-attention step), only the keys are rotated, into
    /// the cache and not back, and each token's angles go to `turns` for flash attention to rotate
    /// the queries with as it loads them: 67 MB a layer less to move for the 8B at 2048 tokens.
    pub(super) fn rotate_and_store(
        &self,
        new: NewRows,
        kv: AttentionKv<'_, Option<FlashPlan>>,
        n_tokens: usize,
        shape: AttentionShape,
        turns: Option<BlockHandle>,
    ) -> Result<()> {
        let page_size = page_size_arg(&kv.pages)?;
        let (dims, halves, scale) = rope_args(new.rope)?;
        let heads = shape.n_heads + shape.n_kv_heads;
        // A flash step's blocks take all of a token's key heads, or one each where the step's
        // tokens alone would leave multiprocessors idle (each block turns its own angles).
        let few_tokens = n_tokens < 2 * self.device.multiprocessors as usize;
        let (first_head, group) = match turns {
            Some(_) if few_tokens => (shape.n_heads, 1),
            Some(_) => (shape.n_heads, shape.n_kv_heads),
            None if n_tokens >= FLASH_MIN_TOKENS => (0, heads),
            None => (0, ROPE_HEADS),
        };
        let groups = (heads - first_head).div_ceil(group);
        self.launch(
            &format!("rope_kv_write_{}", self.kv_suffix()),
            (n_tokens as u32, groups as u32, 1),
            256,
            &RopeKvWriteParams {
                q: self.ptr(new.q),
                k: self.ptr(new.k),
                v: self.ptr(new.v),
                k_cache: self.ptr(kv.k_cache),
                v_cache: self.ptr(kv.v_cache),
                positions: self.ptr(kv.positions),
                freqs: self.ptr(new.freqs),
                tables: self.ptr(kv.pages.block_tables),
                table_width: kv.pages.table_width as i32,
                token_seqs: self.ptr(kv.pages.token_seqs),
                page_size,
                n_heads: shape.n_heads as i32,
                n_kv_heads: shape.n_kv_heads as i32,
                head_dim: shape.head_dim as i32,
                dims,
                halves,
                scale,
                first_head: first_head as i32,
                group: group as i32,
                turns_out: turns.map_or(0, |t| self.ptr(t)),
            },
        )
    }
}
