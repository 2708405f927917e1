//! The expert products of grouped steps on the tensor cores (kernels/expert_gemm.cu): one launch
//! for every expert of the set, over the slots that `group_pairs` left grouped on the device.

use super::params::ExpertProductParams;
use super::CudaBackend;
use crate::{Error, Result};

/// Slots a block takes (EG_SLOTS in kernels/expert_gemm.cu).
const SLOTS: usize = 64;

/// Weight rows a block takes (EG_ROWS): with GLU, half of them gate's and half up's.
const ROWS: usize = 64;

impl CudaBackend {
    /// Launches the grouped product `params` describes on weights with kernel suffix `suffix`
    /// (with `glu`, act(gate) * up). Blocks: the output rows' tiles by the most tiles of slots
    /// that `n_pairs` placed over `n_experts` groups can need; those past the last tile exit.
    pub(super) fn launch_expert_gemm(
        &self,
        params: &ExpertProductParams,
        suffix: &str,
        glu: bool,
        n_pairs: usize,
    ) -> Result<()> {
        let n_experts = params.n_experts as usize;
        // Each nonempty group's last tile may be partial: one more than its full tiles.
        let slot_tiles = n_pairs / SLOTS + n_experts.min(n_pairs);
        let slot_tiles = u32::try_from(slot_tiles)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| Error::Backend(format!("experts: {slot_tiles} tiles of grouped pairs")))?;
        let rows = if glu { ROWS / 2 } else { ROWS };
        let row_tiles = (params.n_out as usize).div_ceil(rows) as u32;
        self.launch(
            &super::kernels::expert_gemm_kernel(glu, suffix),
            (row_tiles, slot_tiles, 1),
            256,
            params,
        )
    }
}
