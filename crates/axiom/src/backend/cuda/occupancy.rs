//! Occupancy tuning: where the GPU places the blocks of a few kernels, steered through the
//! shared memory they ask for (padding, the carveout, the dynamic limit).

use super::device::{driver_error, CudaDevice};
use crate::Result;
use cudarc::driver::sys;

/// A kernel whose grids smaller than what the GPU holds at once are spread evenly over the
/// multiprocessors: launched with unused dynamic shared memory enough that a multiprocessor holds
/// no more of its blocks than an even spread gives each. Left to itself the GPU places such a grid
/// on fewer multiprocessors, each streaming more of the weights (as wo's and down's blocks did).
#[derive(Clone, Copy)]
pub(super) struct EvenSpread {
    multiprocessors: u32,
    /// Blocks a multiprocessor holds without padding.
    blocks_per_multiprocessor: u32,
    /// The kernel's own shared memory, a multiprocessor's, and what each block reserves besides.
    kernel_shared: u32,
    multiprocessor_shared: u32,
    reserved_shared: u32,
}

impl EvenSpread {
    pub(super) fn new(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<Option<EvenSpread>> {
        use sys::CUdevice_attribute as A;
        let (multiprocessor_shared, reserved_shared) = (
            device.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            device.attribute(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
        );
        let kernel_shared = kernel_shared(f)?;
        if multiprocessor_shared < 2 * (kernel_shared + reserved_shared) {
            return Ok(None);
        }
        allow_dynamic_shared(device, f)?;
        let blocks_per_multiprocessor = f
            .occupancy_max_active_blocks_per_multiprocessor(256, 0, None)
            .map_err(driver_error("occupancy"))?;
        Ok(Some(EvenSpread {
            multiprocessors: device.multiprocessors,
            blocks_per_multiprocessor,
            kernel_shared,
            multiprocessor_shared,
            reserved_shared,
        }))
    }

    /// The dynamic shared memory for a launch of `blocks`: enough that no multiprocessor can hold
    /// more than its even share of them, or none where the grid fills the GPU anyway.
    pub(super) fn padding(&self, blocks: u32) -> u32 {
        let share = blocks.div_ceil(self.multiprocessors).max(1);
        if share >= self.blocks_per_multiprocessor {
            return 0;
        }
        // share + 1 blocks of this size overflow the multiprocessor's shared memory.
        let block = self.multiprocessor_shared / (share + 1) + 1;
        (block - self.reserved_shared).saturating_sub(self.kernel_shared)
    }
}

/// Asks the driver to give the multiprocessors that run `f` the most of their L1 as shared memory
/// (the carveout), for kernels such as Q4_K's one-token gate/up, whose four blocks a
/// multiprocessor the driver would otherwise not fit. Set on every kernel, it slows the others.
pub(super) fn prefer_shared_memory(f: &cudarc::driver::CudaFunction) -> Result<()> {
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_MAX_SHARED as i32,
    )
    .map_err(driver_error("kernel attribute"))
}

/// The shared memory a small launch of quantize_q8 (the down projection's input in decode: 14
/// blocks for the 8B) asks for and leaves unused: half a multiprocessor's, so that each block has
/// a multiprocessor to itself but for at most two of the products' blocks. Gate/up starts it
/// early (`start_dependents` in common.cuh), and its blocks were placed beside gate/up's last ones
/// and then down's first ones, competing with them. Q8_0's decode (one row a warp) does not gain
/// by it, so it is Q4_K's only. 0 where the device cannot give it.
pub(super) fn quantize_padding(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<u32> {
    let half =
        device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? / 2 + 1;
    Ok(if half <= allow_dynamic_shared(device, f)? {
        half
    } else {
        0
    })
}

/// The shared memory a kernel declares itself.
fn kernel_shared(f: &cudarc::driver::CudaFunction) -> Result<u32> {
    Ok(
        f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(driver_error("kernel attribute"))? as u32,
    )
}

/// Lets launches of `f` ask for dynamic shared memory up to what a block may have beside the
/// kernel's own; returns that most.
pub(super) fn allow_dynamic_shared(device: &CudaDevice, f: &cudarc::driver::CudaFunction) -> Result<u32> {
    let block_most =
        device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    let most = block_most.saturating_sub(kernel_shared(f)?);
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        most as i32,
    )
    .map_err(driver_error("kernel attribute"))?;
    Ok(most)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_spreads_hold_a_share_of_blocks_a_multiprocessor() {
        // The H200's shared memory, and Q4_K's one-token product kernel (three blocks a
        // multiprocessor by registers).
        let products = EvenSpread {
            multiprocessors: 132,
            blocks_per_multiprocessor: 3,
            kernel_shared: 36_864,
            multiprocessor_shared: 233_472,
            reserved_shared: 1024,
        };
        let holds = |blocks| {
            let block = products.padding(blocks) + products.kernel_shared + products.reserved_shared;
            (products.multiprocessor_shared / block).min(products.blocks_per_multiprocessor)
        };
        assert_eq!(holds(256), 2);
        assert_eq!(holds(132), 1);
        assert_eq!(holds(40), 1);
        assert_eq!(products.padding(384), 0);
        assert_eq!(products.padding(1792), 0);
    }
}
