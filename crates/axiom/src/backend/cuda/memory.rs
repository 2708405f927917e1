//! Device memory: the one allocation reserved at load (the arena, with the argmax and attention
//! states past its end), and the staging buffers a step's paths need, reserved once.

use super::argmax::ARGMAX_ROWS;
use super::attention::ATTENTION_MAX_HEAD_DIM;
use super::device::driver_error;
use super::flash_attention::FLASH_MAX_PAIRS;
use super::matmul::q8_scale_bytes;
use super::paths::Paths;
use super::CudaBackend;
use crate::backend::{Arena, Kernels};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

pub(super) const ALIGN: usize = 256;

impl CudaBackend {
    /// `Kernels::reserve`.
    pub(super) fn reserve_memory(&mut self, bytes: usize) -> Result<()> {
        if self.memory.is_some() {
            return Err(Error::Backend("the arena is already reserved".into()));
        }
        let free = self.device.free_memory()?;
        if bytes > free {
            return Err(Error::OutOfMemory(format!(
                "the model needs {bytes} bytes of GPU memory, {free} are free"
            )));
        }
        let arena_end = bytes.next_multiple_of(ALIGN);
        let argmax_state = ARGMAX_ROWS * 12;
        let partials = self.device.multiprocessors as usize * (ATTENTION_MAX_HEAD_DIM + 2) * 8;
        // SAFETY: plain allocation on our stream.
        let memory = unsafe { self.stream.alloc::<u8>(arena_end + argmax_state + partials) }
            .map_err(driver_error("allocation"))?;
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&memory, &self.stream);
        self.base = ptr;
        drop(_sync);
        self.memory = Some(memory);
        self.argmax_state = ptr + arena_end as u64;
        self.attention_partials = self.argmax_state + argmax_state as u64;
        // SAFETY: within the allocation just made, on its stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.argmax_state,
                0,
                argmax_state + partials,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("memset"))?;
        self.arena = Arena::new(bytes);
        Ok(())
    }

    /// `Kernels::prepare`.
    pub(super) fn reserve_staging(&mut self, max_tokens: usize, max_n_in: usize) -> Result<()> {
        if self.staging.is_none() && self.paths.uses_cublas(max_tokens) {
            let w = self.alloc(self.largest_weight * 2)?;
            let x = self.alloc(max_tokens * max_n_in * 2)?;
            self.staging = Some((w, x));
        }
        if self.int8_activations.is_none() {
            let values = self.paths.int8_tokens(max_tokens) * max_n_in;
            // Scales sized for the larger layout, Q4_K's (with the sums).
            let scales = q8_scale_bytes(GgmlType::Q4K, values);
            self.int8_activations = Some((self.alloc(values)?, self.alloc(scales)?));
        }
        if self.flash_tiles.is_none() && self.paths.uses_flash(max_tokens) {
            self.flash_tiles = Some(self.alloc(max_tokens * 8)?);
            self.flash_turns = Some(self.alloc(max_tokens * FLASH_MAX_PAIRS * 8)?);
        }
        Ok(())
    }
}

/// `Kernels::staging_bytes`, for steps that take `paths`.
pub(super) fn staging_bytes(paths: Paths, largest_weight: usize, max_tokens: usize, max_n_in: usize) -> usize {
    let cublas = if paths.uses_cublas(max_tokens) {
        largest_weight * 2 + max_tokens * max_n_in * 2 + 2 * ALIGN
    } else {
        0
    };
    let flash = if paths.uses_flash(max_tokens) {
        max_tokens * 8 + max_tokens * FLASH_MAX_PAIRS * 8 + 2 * ALIGN
    } else {
        0
    };
    let int8 = paths.int8_tokens(max_tokens) * max_n_in * 2 + 2 * ALIGN;
    cublas + flash + int8
}
