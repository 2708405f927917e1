//! The expert products of grouped steps on the tensor cores (kernels/expert_gemm.cu): one launch
//! for every expert of the set, over the slots that `group_pairs` left grouped on the device.

use super::device::CudaDevice;
use super::kernels::{self, Kernels};
use super::occupancy::allow_dynamic_shared;
use super::params::ExpertProductParams;
use super::CudaBackend;
use crate::backend::GPU_WEIGHT_TYPES;
use crate::{Error, Result};

/// Slots a block takes (EG_SLOTS in kernels/expert_gemm.cu).
const SLOTS: usize = 64;

/// Weight rows a block takes (Tile::ROWS) for weights of kernel suffix `suffix`: 64 for 16-bit
/// floats, 128 for quantized types. With GLU, half of them gate's and half up's.
fn rows(suffix: &str) -> usize {
    match suffix {
        "f16" | "bf16" => 64,
        _ => 128,
    }
}

/// A block's shared memory: its tiles of slots and of `rows` weight rows, 128 16-bit values deep
/// (EG_DEPTH), each row padded by 16 bytes.
fn shared_bytes(rows: usize) -> u32 {
    ((SLOTS + rows) * (128 + 8) * 2) as u32
}

/// Lets every grouped expert kernel ask for its tiles' shared memory, more than a block has
/// without asking.
pub(super) fn allow_expert_gemm_shared(device: &CudaDevice, kernels: &Kernels) -> Result<()> {
    let gemm_types = GPU_WEIGHT_TYPES.iter().filter(|(ty, _)| kernels::has_expert_gemm(*ty));
    for (glu, (_, suffix)) in gemm_types.flat_map(|t| [(false, t), (true, t)]) {
        let name = kernels::expert_gemm_kernel(glu, suffix);
        let needed = shared_bytes(rows(suffix));
        let most = allow_dynamic_shared(device, kernels.get(&name)?)?;
        if most < needed {
            return Err(Error::Backend(format!(
                "{name} needs {needed} bytes of shared memory a block; the device allows {most}"
            )));
        }
    }
    Ok(())
}

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
        let rows = rows(suffix);
        let outputs = if glu { rows / 2 } else { rows };
        let row_tiles = (params.n_out as usize).div_ceil(outputs) as u32;
        self.launch_shared(
            &kernels::expert_gemm_kernel(glu, suffix),
            (row_tiles, slot_tiles, 1),
            256,
            shared_bytes(rows),
            params,
        )
    }
}
