//! Rotary position embeddings (kernels/rope.cu), and the RoPE arguments of every kernel that
//! rotates.

use super::params::RopeParams;
use super::CudaBackend;
use crate::backend::{BlockHandle, Rope, RopeLayout};
use crate::{Error, Result};

/// The most rotated pairs of a head (rope_kv_write.cu).
const ROPE_MAX_PAIRS: usize = 128;

/// The rotated dimensions, whether pairs are halves apart and the factor on cosine and sine, as
/// the RoPE kernels take them.
pub(super) fn rope_args(rope: Rope) -> Result<(i32, i32, f32)> {
    if rope.dims > 2 * ROPE_MAX_PAIRS {
        return Err(Error::Backend(format!(
            "RoPE over {} dimensions: the CUDA kernels take up to {}",
            rope.dims,
            2 * ROPE_MAX_PAIRS
        )));
    }
    Ok((
        rope.dims as i32,
        i32::from(rope.layout == RopeLayout::Halves),
        rope.scale,
    ))
}

impl CudaBackend {
    /// `Kernels::rope`.
    pub(super) fn launch_rope(
        &self,
        x: BlockHandle,
        positions: BlockHandle,
        freqs: BlockHandle,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<()> {
        let (dims, halves, scale) = rope_args(rope)?;
        self.launch(
            "rope",
            (n_tokens as u32, n_heads as u32, 1),
            64,
            &RopeParams {
                x: self.ptr(x),
                positions: self.ptr(positions),
                freqs: self.ptr(freqs),
                n_heads: n_heads as i32,
                head_dim: head_dim as i32,
                dims,
                halves,
                scale,
            },
        )
    }
}
