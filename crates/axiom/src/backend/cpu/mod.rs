//! The CPU backend: the reference every GPU kernel is tested against.
//!
//! Its four layers mirror the GPU backends: the device is the host (a thread count), the
//! context is trivially in order, the allocator is an [`Arena`] over one zeroed host allocation,
//! and the kernels are the plain functions in [`kernels`]. Weights are read in place from the
//! memory-mapped model file.

pub mod kernels;

use super::{Arena, AttentionShape, Backend, BlockHandle, HostTensor, Rope};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use memmap2::Mmap;
use std::alloc::{self, Layout};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

const ALIGN: usize = 64;

/// A weight matrix `[n_out, n_in]` in its stored type.
pub struct CpuWeight {
    pub ty: GgmlType,
    pub n_out: usize,
    pub n_in: usize,
    data: WeightData,
}

enum WeightData {
    Mapped(Arc<Mmap>, Range<usize>),
    Owned(Vec<u8>),
}

impl CpuWeight {
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            WeightData::Mapped(map, range) => &map[range.clone()],
            WeightData::Owned(v) => v,
        }
    }
}

/// The host memory the arena hands out.
struct HostMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `reserve` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

pub struct CpuBackend {
    threads: usize,
    memory: Option<HostMemory>,
    arena: Arena,
}

// SAFETY: the raw arena pointer is owned by the backend and only reached through `&self`/`&mut self`.
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend {
            threads: threads.max(1),
            memory: None,
            arena: Arena::new(0),
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    fn base(&self, block: BlockHandle) -> *mut u8 {
        let memory = self.memory.as_ref().expect("alloc before reserve is rejected");
        assert!(
            block.end() <= self.arena.capacity(),
            "block {block:?} outside the arena"
        );
        // SAFETY: in bounds of the allocation, checked above.
        unsafe { memory.ptr.as_ptr().add(block.offset) }
    }

    /// A read view of a block as `n` values of `T`.
    fn view<T>(&self, block: BlockHandle, n: usize) -> &[T] {
        assert!(n * size_of::<T>() <= block.len, "{n} values do not fit {block:?}");
        // SAFETY: blocks are 64-byte aligned and in bounds; kernels never write a block they read
        // (see `view_mut`), and the arena memory is initialised (zeroed at reserve).
        unsafe { std::slice::from_raw_parts(self.base(block) as *const T, n) }
    }

    /// A write view of a block. The backend is driven from one thread and each kernel call takes
    /// at most one view of any block, with outputs checked disjoint from inputs.
    #[allow(clippy::mut_from_ref)]
    fn view_mut<T>(&self, block: BlockHandle, n: usize) -> &mut [T] {
        assert!(n * size_of::<T>() <= block.len, "{n} values do not fit {block:?}");
        // SAFETY: as `view`; exclusivity is the caller's `disjoint` check.
        unsafe { std::slice::from_raw_parts_mut(self.base(block) as *mut T, n) }
    }
}

/// Physical cores (hyper-threads of one core share its vector units, so they add little to
/// these kernels); the logical count where the topology cannot be read.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores: std::collections::HashSet<String> = (0..logical)
        .filter_map(|cpu| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list")).ok()
        })
        .collect();
    if cores.is_empty() {
        logical
    } else {
        cores.len()
    }
}

/// Kernels read inputs and write outputs through separate views: they must not overlap.
fn disjoint(outputs: &[BlockHandle], inputs: &[BlockHandle]) -> Result<()> {
    for (i, o) in outputs.iter().enumerate() {
        if inputs.iter().chain(&outputs[i + 1..]).any(|x| x.overlaps(o)) {
            return Err(Error::Backend(format!("output block {o:?} overlaps another argument")));
        }
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Weight = CpuWeight;

    fn device_name(&self) -> String {
        format!("CPU ({} threads)", self.threads)
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.memory.is_some() {
            return Err(Error::Backend("the arena is already reserved".into()));
        }
        let layout = Layout::from_size_align(bytes.max(ALIGN), ALIGN)
            .map_err(|_| Error::Backend(format!("cannot reserve {bytes} bytes")))?;
        // SAFETY: the layout has non-zero size. Zeroed memory is committed lazily by the OS.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| Error::OutOfMemory(format!("reserving a {bytes}-byte arena")))?;
        self.memory = Some(HostMemory { ptr, layout });
        self.arena = Arena::new(bytes);
        Ok(())
    }

    fn alloc(&mut self, bytes: usize) -> Result<BlockHandle> {
        if self.memory.is_none() {
            return Err(Error::Backend("alloc before reserve".into()));
        }
        Ok(self.arena.alloc(bytes, ALIGN)?)
    }

    fn free(&mut self, block: BlockHandle) -> Result<()> {
        Ok(self.arena.free(block)?)
    }

    fn upload_weight(&mut self, t: &HostTensor) -> Result<CpuWeight> {
        let (n_in, n_out) = match *t.dims {
            [n_in, n_out] => (n_in, n_out),
            [n_in] => (n_in, 1),
            _ => {
                return Err(Error::Model(format!(
                    "tensor {} has shape {:?}, expected a matrix",
                    t.name, t.dims
                )))
            }
        };
        let data = match &t.region {
            Some((map, range)) => WeightData::Mapped(map.clone(), range.clone()),
            None => WeightData::Owned(t.bytes.to_vec()),
        };
        Ok(CpuWeight {
            ty: t.ty,
            n_out,
            n_in,
            data,
        })
    }

    fn write_f32(&self, dst: BlockHandle, src: &[f32]) -> Result<()> {
        self.view_mut(dst, src.len()).copy_from_slice(src);
        Ok(())
    }

    fn write_u32(&self, dst: BlockHandle, src: &[u32]) -> Result<()> {
        self.view_mut(dst, src.len()).copy_from_slice(src);
        Ok(())
    }

    fn read_f32(&self, src: BlockHandle, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(self.view(src, dst.len()));
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn embed(&self, table: &CpuWeight, ids: BlockHandle, out: BlockHandle, n_tokens: usize) -> Result<()> {
        disjoint(&[out], &[ids])?;
        let ids = self.view::<u32>(ids, n_tokens);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.n_out) {
            return Err(Error::Model(format!(
                "token id {bad} is outside the vocabulary of {}",
                table.n_out
            )));
        }
        kernels::embed::embed(
            table.ty,
            table.bytes(),
            table.n_in,
            ids,
            self.view_mut(out, n_tokens * table.n_in),
        );
        Ok(())
    }

    fn rms_norm(
        &self,
        x: BlockHandle,
        weight: BlockHandle,
        out: BlockHandle,
        n_tokens: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        disjoint(&[out], &[x, weight])?;
        let n = n_tokens * dim;
        kernels::rms_norm::rms_norm(self.view(x, n), self.view(weight, dim), self.view_mut(out, n), dim, eps);
        Ok(())
    }

    fn matmul(&self, x: BlockHandle, w: &CpuWeight, out: BlockHandle, n_tokens: usize) -> Result<()> {
        disjoint(&[out], &[x])?;
        let x = self.view::<f32>(x, n_tokens * w.n_in);
        let out = self.view_mut::<f32>(out, n_tokens * w.n_out);
        // Split the output rows across threads; each returns its [n_tokens, rows] slab.
        let per_thread = w.n_out.div_ceil(self.threads);
        let slabs: Vec<(Range<usize>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..w.n_out)
                .step_by(per_thread)
                .map(|start| {
                    let rows = start..(start + per_thread).min(w.n_out);
                    s.spawn(move || {
                        let mut slab = vec![0f32; n_tokens * rows.len()];
                        kernels::matmul::matmul_rows(w.ty, w.bytes(), w.n_in, rows.clone(), x, &mut slab);
                        (rows, slab)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("matmul worker panicked"))
                .collect()
        });
        for (rows, slab) in slabs {
            for (t, chunk) in slab.chunks_exact(rows.len()).enumerate() {
                out[t * w.n_out + rows.start..t * w.n_out + rows.end].copy_from_slice(chunk);
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: BlockHandle,
        positions: BlockHandle,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<()> {
        disjoint(&[x], &[positions])?;
        let x = self.view_mut(x, n_tokens * n_heads * head_dim);
        kernels::rope::rope(x, self.view(positions, n_tokens), n_heads, head_dim, rope);
        Ok(())
    }

    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()> {
        disjoint(&[k_cache, v_cache], &[k, v, positions])?;
        let positions = self.view::<u32>(positions, n_tokens);
        let capacity = k_cache.len / (kv_width * 4);
        if let Some(&bad) = positions.iter().find(|&&p| p as usize >= capacity) {
            return Err(Error::Backend(format!(
                "position {bad} is beyond the KV cache capacity {capacity}"
            )));
        }
        let n = n_tokens * kv_width;
        let cache_len = capacity * kv_width;
        kernels::kv_write::kv_write(
            self.view(k, n),
            self.view(v, n),
            self.view_mut(k_cache, cache_len),
            self.view_mut(v_cache, cache_len),
            positions,
            kv_width,
        );
        Ok(())
    }

    fn attention(
        &self,
        q: BlockHandle,
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        positions: BlockHandle,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        disjoint(&[out], &[q, k_cache, v_cache, positions])?;
        let cache_len = k_cache.len / 4;
        let n = n_tokens * shape.q_width();
        kernels::attention::attention(
            self.view(q, n),
            self.view(k_cache, cache_len),
            self.view(v_cache, cache_len),
            self.view(positions, n_tokens),
            self.view_mut(out, n),
            shape,
        );
        Ok(())
    }

    fn swiglu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize) -> Result<()> {
        disjoint(&[out], &[gate, up])?;
        kernels::swiglu::swiglu(self.view(gate, n), self.view(up, n), self.view_mut(out, n));
        Ok(())
    }

    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        disjoint(&[x], &[y])?;
        kernels::add::add(self.view_mut(x, n), self.view(y, n));
        Ok(())
    }
}
