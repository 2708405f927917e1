//! Device memory: the one allocation reserved at load (the arena, with the argmax and attention
//! states past its end), and the staging buffers a step's paths need, reserved once.

use super::argmax::ARGMAX_ROWS;
use super::attention::ATTENTION_MAX_HEAD_DIM;
use super::device::driver_error;
use super::flash_attention::FLASH_MAX_PAIRS;
use super::fp8_gemm::{fp8_activation_bytes, LT_WORKSPACE_BYTES};
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
        let router_done = 16;
        let zeroed = argmax_state + partials + router_done;
        // SAFETY: plain allocation on our stream.
        let memory = unsafe { self.stream.alloc::<u8>(arena_end + zeroed) }.map_err(driver_error("allocation"))?;
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&memory, &self.stream);
        self.base = ptr;
        drop(_sync);
        self.memory = Some(memory);
        self.argmax_state = ptr + arena_end as u64;
        self.attention_partials = self.argmax_state + argmax_state as u64;
        self.router_done = self.attention_partials + partials as u64;
        // SAFETY: within the allocation just made, on its stream.
        unsafe { cudarc::driver::result::memset_d8_async(self.argmax_state, 0, zeroed, self.stream.cu_stream()) }
            .map_err(driver_error("memset"))?;
        self.arena = Arena::new(bytes);
        Ok(())
    }

    /// `Kernels::prepare`.
    pub(super) fn reserve_staging(&mut self, max_tokens: usize, max_n_in: usize) -> Result<()> {
        if self.staging.is_none() && self.paths.uses_cublas(max_tokens) {
            let fp8 = self.fp8_tensor_cores();
            let w = self.alloc(weight_stage_bytes(self.largest_weight, max_tokens, max_n_in, fp8))?;
            let x = self.alloc(max_tokens * max_n_in * 2)?;
            self.staging = Some((w, x));
        }
        let lt_unreserved = self.fp8_lt.as_ref().is_some_and(|lt| lt.workspace.is_none());
        if lt_unreserved && self.fp8_tensor_cores() && self.paths.uses_cublas(max_tokens) {
            let workspace = self.alloc(LT_WORKSPACE_BYTES)?;
            if let Some(lt) = self.fp8_lt.as_mut() {
                lt.workspace = Some(workspace);
            }
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

/// The staging of a dequantized weight for cuBLAS, which also takes a step's activations
/// quantized for the FP8 tensor cores (`fp8`: where prompts' FP8 products may run there).
fn weight_stage_bytes(largest_weight: usize, max_tokens: usize, max_n_in: usize, fp8: bool) -> usize {
    let fp8_activations = if fp8 {
        fp8_activation_bytes(max_tokens, max_n_in)
    } else {
        0
    };
    (largest_weight * 2).max(fp8_activations)
}

/// `Kernels::staging_bytes`, for steps that take `paths`; `fp8` where prompts' FP8 products may
/// run on the FP8 tensor cores (cuBLASLt's workspace too).
pub(super) fn staging_bytes(
    paths: Paths,
    largest_weight: usize,
    max_tokens: usize,
    max_n_in: usize,
    fp8: bool,
) -> usize {
    let cublas = if paths.uses_cublas(max_tokens) {
        let workspace = if fp8 { LT_WORKSPACE_BYTES } else { 0 };
        weight_stage_bytes(largest_weight, max_tokens, max_n_in, fp8)
            + max_tokens * max_n_in * 2
            + workspace
            + 3 * ALIGN
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
