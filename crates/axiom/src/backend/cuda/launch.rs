//! Launch plumbing: the one call every kernel launch goes through, and the conversions of handles,
//! types and sizes into the parameters the kernels take.

use super::device::driver_error;
use super::params::KernelParams;
use super::CudaBackend;
use crate::backend::{gpu_kernel_suffix, BlockHandle, KvType, PagedKv};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;

impl CudaBackend {
    pub(super) fn ptr(&self, block: BlockHandle) -> u64 {
        self.base + block.offset as u64
    }

    pub(super) fn kv_suffix(&self) -> &'static str {
        match self.kv_type {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }

    pub(super) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &impl KernelParams,
    ) -> Result<()> {
        self.launch_shared(name, grid, block, 0, params)
    }

    /// Launches kernel `name` on its parameter struct, its one argument (copied by the launch, and
    /// into a graph being captured, so it need not outlive the call).
    pub(super) fn launch_shared<P: KernelParams>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        params: &P,
    ) -> Result<()> {
        let f = self.kernels.launchable::<P>(name)?.cu_function();
        let mut args = [params as *const _ as *mut c_void];
        // Every kernel waits for its inputs itself (begin_after_inputs in common.cuh), so each may
        // be scheduled while the one before is finishing.
        let mut overlap = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.device.dependent_launch),
        };
        // SAFETY: every kernel takes one struct, laid out as its `KernelParams` (params.rs, checked
        // against kernels/params.cuh by tests/cuda_nvrtc.rs); pointers are arena blocks sized by the
        // caller's checked shapes; `args` and `overlap` outlive the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&config, f, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(driver_error(name))
    }

    pub(super) fn type_suffix(ty: GgmlType) -> Result<&'static str> {
        gpu_kernel_suffix(ty).ok_or_else(|| Error::UnsupportedTensorType {
            name: String::new(),
            ty: ty.to_string(),
            op: "the CUDA backend",
        })
    }
}

/// The page size as the kernels take it: a power of two, so that page_row (common.cuh) finds a
/// position's page by a shift rather than a division.
pub(super) fn page_size_arg(pages: &PagedKv) -> Result<i32> {
    match i32::try_from(pages.page_size) {
        Ok(size) if size > 0 && (size as u32).is_power_of_two() => Ok(size),
        _ => Err(Error::Backend(format!(
            "KV pages of {} positions: the CUDA kernels take powers of two",
            pages.page_size
        ))),
    }
}

pub(super) fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 65535 * 16) as u32
}
