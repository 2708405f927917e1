//! The GPU itself: found through the CUDA driver, loaded at run time so that axiom builds and
//! runs on machines without CUDA.

use crate::{Error, Result};
use cudarc::driver::{sys, CudaContext, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use std::sync::Arc;

pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    /// Compute capability as NVRTC's architecture name, e.g. "sm_90a".
    pub arch: &'static str,
    pub total_memory: usize,
    pub multiprocessors: u32,
    pub driver_version: i32,
    /// Whether kernels may be launched to overlap the end of the one before (programmatic
    /// dependent launch, compute capability 9.0 and later; see common.cuh).
    pub dependent_launch: bool,
}

pub(crate) fn driver_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("CUDA {what}: {e}"))
}

/// Whether the CUDA driver library can be loaded and reports at least one device.
pub fn available() -> bool {
    // SAFETY: only probes for the shared library.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::result::init().is_ok() && CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// GPUs this process sees (after `CUDA_VISIBLE_DEVICES`).
pub fn count() -> Result<usize> {
    // SAFETY: only probes for the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Backend(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    let count = CudaContext::device_count().map_err(driver_error("device count"))?;
    Ok(count.max(0) as usize)
}

impl CudaDevice {
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Backend(
                "the CUDA driver library (libcuda.so) is not installed".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error("device"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_error("compute capability"))?;
        let arch = nvrtc_arch(major, minor)?;
        let mut driver_version = 0;
        // SAFETY: plain query into a local.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        Ok(CudaDevice {
            name: ctx.name().map_err(driver_error("device name"))?,
            total_memory: ctx.total_mem().map_err(driver_error("memory size"))?,
            multiprocessors: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(driver_error("device attribute"))? as u32,
            arch,
            driver_version,
            dependent_launch: major >= 9,
            ctx,
        })
    }

    /// A device attribute; those axiom reads are counts and sizes, never negative.
    pub fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<u32> {
        Ok(self
            .ctx
            .attribute(attribute)
            .map_err(driver_error("device attribute"))? as u32)
    }

    pub fn free_memory(&self) -> Result<usize> {
        Ok(self.ctx.mem_get_info().map_err(driver_error("free memory"))?.0)
    }
}

fn nvrtc_arch(major: i32, minor: i32) -> Result<&'static str> {
    Ok(match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        // Hopper's own instructions (the warpgroup MMAs) need the architecture-specific target.
        (9, 0) => "sm_90a",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => {
            return Err(Error::Backend(format!(
                "compute capability {major}.{minor} is not supported"
            )))
        }
    })
}

/// Page-locked host memory: the GPU copies into it directly, where a copy into ordinary
/// (pageable) memory goes through the driver's staging buffer and a second, CPU-side copy.
pub struct Pinned<T: DeviceRepr> {
    memory: PinnedHostSlice<T>,
    ptr: *mut T,
}

pub type PinnedF32 = Pinned<f32>;

// SAFETY: the memory is owned by `memory` and only reached through `&self` / `&mut self`.
unsafe impl<T: DeviceRepr> Send for Pinned<T> {}
unsafe impl<T: DeviceRepr> Sync for Pinned<T> {}

impl<T: DeviceRepr + ValidAsZeroBits> Pinned<T> {
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned<T>> {
        Self::with_flags(ctx, len, 0)
    }

    /// Memory that kernels write directly, at the returned device address: no copy after them.
    pub fn mapped(ctx: &Arc<CudaContext>, len: usize) -> Result<(Pinned<T>, sys::CUdeviceptr)> {
        let pinned = Self::with_flags(ctx, len, sys::CU_MEMHOSTALLOC_DEVICEMAP)?;
        let mut device = 0;
        // SAFETY: `pinned` was allocated with the device-map flag in the current context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, pinned.ptr.cast(), 0) }
            .result()
            .map_err(driver_error("mapped host memory"))?;
        Ok((pinned, device))
    }

    fn with_flags(ctx: &Arc<CudaContext>, len: usize, flags: u32) -> Result<Pinned<T>> {
        // Not write-combined (cudarc's default): the CPU reads this memory.
        // SAFETY: the memory is zeroed below before anything reads it.
        let mut memory = unsafe { ctx.alloc_pinned_with_flags::<T>(len, flags) }
            .map_err(|e| Error::OutOfMemory(format!("{len} values of page-locked host memory: {e}")))?;
        let ptr = memory.as_mut_ptr().map_err(driver_error("pinned memory"))?;
        // SAFETY: `len` values were just allocated at `ptr`, and all-zero bits are one of them.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Pinned { memory, ptr })
    }
}

impl<T: DeviceRepr> std::ops::Deref for Pinned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `memory.len()` initialised values for as long as `memory` lives;
        // copies into it are waited for before the backend hands it back.
        unsafe { std::slice::from_raw_parts(self.ptr, self.memory.len()) }
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for Pinned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for Deref; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.memory.len()) }
    }
}
