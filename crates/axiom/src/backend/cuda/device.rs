//! The GPU itself: found through the CUDA driver, loaded at run time so that axiom builds and
//! runs on machines without CUDA.

use crate::{Error, Result};
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    /// Compute capability as NVRTC's architecture name, e.g. "sm_90".
    pub arch: &'static str,
    pub total_memory: usize,
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
            arch,
            driver_version,
            dependent_launch: major >= 9,
            ctx,
        })
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
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => {
            return Err(Error::Backend(format!(
                "compute capability {major}.{minor} is not supported"
            )))
        }
    })
}
