//! The CPU backend: the reference every GPU kernel is tested against, and the fast default
//! where there is no GPU.
//!
//! Its four layers mirror the GPU backends: the device is the host (threads in a persistent
//! [`pool::ThreadPool`], the instruction set found at startup), the context is trivially in
//! order, the allocator is an [`Arena`] over one zeroed host allocation, and the kernels are the
//! plain reference functions in [`kernels`] or, by default, the SIMD ones in [`fast`]. Weights
//! are read in place from the memory-mapped model file.

pub mod fast;
pub mod kernels;
pub mod pool;

use super::{
    Activation, Arena, AttentionKv, AttentionShape, Backend, BlockHandle, ExpertScratch, ExpertSet, HostTensor, Input,
    Kernels, KvType, PagedKv, Rope, Routes, Routing, Scores, StepLayout,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use fast::{Isa, OutPtr, Q8Activations, Stage, CHUNK, GROUPS_PER_CHUNK};
use half::f16;
use kernels::paged::PageMap;
use memmap2::Mmap;
use pool::{split, ThreadPool};
use std::cell::{Cell, RefCell};
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
    /// The same weight interleaved for the AVX-512 integer kernels, when they run.
    repacked: Option<fast::repack::Repacked>,
}
super::impl_matrix!(CpuWeight);

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

/// The host memory the arena hands out: an anonymous mapping, page-aligned, whose zero pages
/// the OS commits only when first touched (so an unused KV cache costs no resident memory).
struct HostMemory {
    /// Owns the mapping `ptr` points into.
    _map: memmap2::MmapMut,
    ptr: NonNull<u8>,
}

/// Which kernels the backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// The plain f32 reference kernels (dequantize, then multiply).
    Reference,
    /// Integer and SIMD kernels for the given instruction set.
    Fast(Isa),
}

pub struct CpuBackend {
    pool: ThreadPool,
    kernels: CpuKernels,
    kv_type: KvType,
    memory: Option<HostMemory>,
    arena: Arena,
    /// Quantized activations of the current matmul, reused between calls.
    activations: RefCell<Q8Activations>,
}

thread_local! {
    /// Each thread's staged weight rows and float row buffer, reused between calls.
    static STAGE: RefCell<(Stage, Vec<f32>)> = RefCell::new((Stage::default(), Vec::new()));
    static ATTENTION: RefCell<fast::attention::Scratch> = RefCell::new(Default::default());
}

// SAFETY: the raw arena pointer is owned by the backend and only reached through `&self`/`&mut self`.
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    /// The fast backend for this machine's instruction set.
    pub fn new(threads: usize) -> CpuBackend {
        Self::with_kernels(threads, CpuKernels::Fast(Isa::detect()))
    }

    /// The reference backend: exact f32 arithmetic on dequantized weights.
    pub fn reference(threads: usize) -> CpuBackend {
        Self::with_kernels(threads, CpuKernels::Reference)
    }

    pub fn with_kernels(threads: usize, kernels: CpuKernels) -> CpuBackend {
        let kv_type = if kernels == CpuKernels::Reference {
            KvType::F32
        } else {
            KvType::F16
        };
        CpuBackend {
            pool: ThreadPool::new(threads.max(1)),
            kernels,
            kv_type,
            memory: None,
            arena: Arena::new(0),
            activations: RefCell::new(Q8Activations::default()),
        }
    }

    pub fn kernels(&self) -> CpuKernels {
        self.kernels
    }

    /// Chooses the KV cache's element type (the reference kernels only read f32).
    pub fn with_kv_type(mut self, kv_type: KvType) -> CpuBackend {
        if self.kernels != CpuKernels::Reference {
            self.kv_type = kv_type;
        }
        self
    }

    /// The step's block tables, checked against the caches (blocks of `kv_width`-wide rows in
    /// whole pages), and the cache length in elements.
    fn page_map(
        &self,
        pages: PagedKv,
        positions: &[u32],
        k_cache: BlockHandle,
        v_cache: BlockHandle,
        kv_width: usize,
    ) -> Result<(PageMap<'_>, usize)> {
        let page_bytes = pages.page_size * kv_width * self.kv_type.bytes();
        if page_bytes == 0 || k_cache.len != v_cache.len {
            return Err(Error::Backend(
                "the K and V caches must be whole pages of one size".into(),
            ));
        }
        let n_pages = k_cache.len / page_bytes;
        let n_seqs = pages.block_tables.len / (4 * pages.table_width.max(1));
        let map = PageMap::new(
            self.view::<u32>(pages.block_tables, n_seqs * pages.table_width),
            pages.table_width,
            self.view::<u32>(pages.token_seqs, positions.len()),
            pages.page_size,
            positions,
            n_pages,
        )?;
        Ok((map, n_pages * pages.page_size * kv_width))
    }

    /// Fast attention over a cache of `T`, work split by (tile of tokens, KV head).
    #[allow(clippy::too_many_arguments)]
    fn attention_fast<T: fast::attention::KvElem>(
        &self,
        isa: Isa,
        q: &[f32],
        k: &[T],
        v: &[T],
        positions: &[u32],
        pages: &PageMap,
        out: &mut [f32],
        shape: AttentionShape,
        scores: Scores,
    ) {
        use fast::attention::{Context, TILE};
        let (hd, group) = (shape.head_dim, shape.n_heads / shape.n_kv_heads);
        // Runs of up to TILE tokens at consecutive positions of one sequence.
        let mut tiles: Vec<std::ops::Range<usize>> = Vec::new();
        for t in 0..positions.len() {
            match tiles.last_mut() {
                Some(tile)
                    if tile.len() < TILE
                        && positions[t] == positions[t - 1] + 1
                        && std::ptr::eq(pages.table(t), pages.table(t - 1)) =>
                {
                    tile.end = t + 1
                }
                _ => tiles.push(t..t + 1),
            }
        }
        let units = tiles.len() * shape.n_kv_heads;
        let threads = self.threads();
        let out = OutPtr(out.as_mut_ptr());
        self.pool.run(&|i| {
            ATTENTION.with_borrow_mut(|scratch| {
                let (mut qs, mut outs, mut ctxs) = (Vec::new(), Vec::new(), Vec::new());
                // Interleaved, not in ranges: later tokens attend to more positions.
                for unit in (i..units).step_by(threads) {
                    let (tile, kv_head) = (&tiles[unit / shape.n_kv_heads], unit % shape.n_kv_heads);
                    qs.clear();
                    outs.clear();
                    ctxs.clear();
                    for t in tile.clone() {
                        let at = t * shape.q_width() + kv_head * group * hd;
                        qs.push(&q[at..at + group * hd]);
                        // SAFETY: each unit writes its own heads of its own tokens.
                        outs.push(unsafe { std::slice::from_raw_parts_mut(out.get().add(at), group * hd) });
                        let pos = positions[t] as usize;
                        ctxs.push(Context {
                            table: pages.table(t),
                            page_size: pages.page_size(),
                            first: scores.first_visible(pos),
                            end: pos + 1,
                            scores,
                        });
                    }
                    match isa {
                        // SAFETY: chosen only when the CPU has AVX-512.
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512Vnni => unsafe {
                            fast::attention::attend_tile_avx512(&qs, k, v, kv_head, &ctxs, shape, &mut outs, scratch)
                        },
                        // SAFETY: chosen only when the CPU has AVX2.
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => unsafe {
                            fast::attention::attend_tile_avx2(&qs, k, v, kv_head, &ctxs, shape, &mut outs, scratch)
                        },
                        _ => fast::attention::attend_tile(&qs, k, v, kv_head, &ctxs, shape, &mut outs, scratch),
                    }
                }
            });
        });
    }

    /// Dequantize-then-multiply, rows split across the threads.
    fn matmul_reference(&self, x: &[f32], w: &CpuWeight, out: &mut [f32], n_tokens: usize) {
        let out = OutPtr(out.as_mut_ptr());
        let threads = self.threads();
        self.pool.run(&|i| {
            let rows = split(w.n_out, i, threads, 1);
            if rows.is_empty() {
                return;
            }
            let mut slab = vec![0f32; n_tokens * rows.len()];
            kernels::matmul::matmul_rows(w.ty, w.bytes(), w.n_in, rows.clone(), x, &mut slab);
            for (t, chunk) in slab.chunks_exact(rows.len()).enumerate() {
                for (j, &v) in chunk.iter().enumerate() {
                    // SAFETY: this thread owns output rows `rows`.
                    unsafe { *out.get().add(t * w.n_out + rows.start + j) = v };
                }
            }
        });
    }

    /// Float weights: each row converted to f32 once, then dotted with every token.
    fn matmul_float(&self, isa: Isa, x: &[f32], w: &CpuWeight, out: &mut [f32], n_tokens: usize) {
        let out = OutPtr(out.as_mut_ptr());
        let threads = self.threads();
        let (n_in, n_out) = (w.n_in, w.n_out);
        self.pool.run(&|i| {
            STAGE.with_borrow_mut(|(_, row)| {
                row.resize(n_in, 0.0);
                for o in split(n_out, i, threads, 1) {
                    float_row(isa, w.ty, w.bytes(), n_in, o, row);
                    for t in 0..n_tokens {
                        let v = dot(isa, row, &x[t * n_in..(t + 1) * n_in]);
                        // SAFETY: this thread owns output row `o`.
                        unsafe { *out.get().add(t * n_out + o) = v };
                    }
                }
            });
        });
    }

    /// Quantized weights: activations to 8-bit blocks, then integer dot products.
    fn matmul_int8(&self, isa: Isa, x: &[f32], w: &CpuWeight, out: &mut [f32], n_tokens: usize) {
        self.quantize_activations(isa, x, w.n_in, n_tokens);
        self.matmul_quantized(isa, w, out, n_tokens);
    }

    /// Quantizes `n_tokens` rows of `n_in` into `self.activations`.
    fn quantize_activations(&self, isa: Isa, x: &[f32], n_in: usize, n_tokens: usize) {
        let threads = self.threads();
        let mut act = self.activations.borrow_mut();
        act.resize(n_tokens, n_in);
        let n_chunks = act.n_chunks;
        let groups = n_chunks * GROUPS_PER_CHUNK;
        {
            let q = OutPtr(act.q.as_mut_ptr() as *mut f32);
            let (d, s) = (OutPtr(act.d.as_mut_ptr()), OutPtr(act.s.as_mut_ptr()));
            self.pool.run(&|i| {
                for t in split(n_tokens, i, threads, 1) {
                    // SAFETY: thread `i` owns row `t` of the three buffers, sized by `resize`.
                    let (q, d, s) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(
                                (q.get() as *mut i8).add(t * n_chunks * CHUNK),
                                n_chunks * CHUNK,
                            ),
                            std::slice::from_raw_parts_mut(d.get().add(t * groups), groups),
                            std::slice::from_raw_parts_mut(s.get().add(t * groups), groups),
                        )
                    };
                    quantize_row(isa, &x[t * n_in..(t + 1) * n_in], q, d, s);
                }
            });
        }
        for t in 0..n_tokens {
            act.sum_runs_of_16(t);
        }
    }

    /// The integer matmul of `w` with the activations quantized last.
    fn matmul_quantized(&self, isa: Isa, w: &CpuWeight, out: &mut [f32], n_tokens: usize) {
        let threads = self.threads();
        let (n_in, n_out) = (w.n_in, w.n_out);
        let act = &*self.activations.borrow();
        debug_assert_eq!(act.n_tokens, n_tokens);
        let n_chunks = act.n_chunks;
        let out = OutPtr(out.as_mut_ptr());
        if let Some(repacked) = &w.repacked {
            let panels = repacked.panels();
            self.pool.run(&|i| {
                let mine = split(panels, i, threads, 1);
                // SAFETY: weights are repacked only for these instruction sets, which the CPU
                // has; `out` holds `[n_tokens, n_out]` and this thread's panels are its own rows.
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512Vnni => unsafe { fast::avx512::matmul_repacked(repacked, act, mine, out.get(), n_out) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { fast::avx2::matmul_repacked(repacked, act, mine, out.get(), n_out) },
                    #[allow(clippy::unreachable, reason = "`Repacked` is built only for these instruction sets")]
                    _ => unreachable!("weights are not repacked for {isa:?}"),
                }
            });
            return;
        }
        self.pool.run(&|i| {
            STAGE.with_borrow_mut(|(stage, _)| {
                stage.resize(4, n_chunks);
                let rows = split(n_out, i, threads, 4);
                for row0 in rows.clone().step_by(4) {
                    let n = (rows.end - row0).min(4);
                    for slot in 0..n {
                        fast::portable::unpack_row(w.ty, w.bytes(), n_in, row0 + slot, stage, slot);
                    }
                    dot_rows(stage, n, act, out, n_out, row0);
                }
            });
        });
    }

    fn base(&self, block: BlockHandle) -> *mut u8 {
        #[allow(
            clippy::expect_used,
            reason = "a block exists only once `reserve` has made the memory"
        )]
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

/// Advises the kernel that a read-only mapped range is not needed for now.
fn release_pages(map: &Mmap, range: Range<usize>) {
    const PAGE: usize = 4096;
    let start = range.start.next_multiple_of(PAGE);
    let end = range.end / PAGE * PAGE;
    if end > start {
        // SAFETY: the map is a read-only file mapping, so dropped pages are re-read from the
        // file on the next access; nothing is lost.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
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

impl Kernels for CpuBackend {
    type Weight = CpuWeight;
    type HostF32 = Vec<f32>;
    type ChoiceSlot = Cell<u32>;
    /// Nothing: the kernels read the step's layout where the host wrote it.
    type StepPlan = ();

    fn kv_type(&self) -> KvType {
        self.kv_type
    }

    fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn device_name(&self) -> String {
        let kernels = match self.kernels {
            CpuKernels::Reference => "reference".to_string(),
            CpuKernels::Fast(isa) => format!("{isa:?}"),
        };
        format!("CPU ({} threads, {kernels})", self.threads())
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.memory.is_some() {
            return Err(Error::Backend("the arena is already reserved".into()));
        }
        let mut map = memmap2::MmapMut::map_anon(bytes.max(ALIGN))
            .map_err(|e| Error::OutOfMemory(format!("reserving a {bytes}-byte arena: {e}")))?;
        let ptr = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| Error::OutOfMemory(format!("reserving a {bytes}-byte arena: null mapping")))?;
        self.memory = Some(HostMemory { _map: map, ptr });
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
        let (n_in, n_out) = t.matrix_shape()?;
        let data = match &t.region {
            Some((map, range)) => WeightData::Mapped(map.clone(), range.clone()),
            None => WeightData::Owned(t.bytes.to_vec()),
        };
        let repack = matches!(self.kernels, CpuKernels::Fast(Isa::Avx512Vnni | Isa::Avx2))
            && fast::repack::Layout::for_type(t.ty).is_some()
            && n_in.is_multiple_of(32);
        let repacked = repack.then(|| fast::repack::Repacked::new(t.ty, t.bytes, n_in, n_out));
        if let (Some(_), Some((map, range))) = (&repacked, &t.region) {
            // The file's pages are not read again by the matmul: let the kernel drop them from
            // this process's resident set (they stay in the page cache). Embedding lookups
            // fault back in only the rows they touch.
            release_pages(map, range.clone());
        }
        Ok(CpuWeight {
            ty: t.ty,
            n_out,
            n_in,
            data,
            repacked,
        })
    }

    fn upload_experts(&mut self, tensors: &[HostTensor]) -> Result<Vec<CpuWeight>> {
        tensors.iter().map(|t| self.upload_weight(t)).collect()
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

    fn read_u32(&self, src: BlockHandle, dst: &mut [u32]) -> Result<()> {
        dst.copy_from_slice(self.view(src, dst.len()));
        Ok(())
    }

    fn host_f32(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
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
        match self.kernels {
            CpuKernels::Fast(isa) if fast::has_int8_kernel(w.ty) => self.matmul_int8(isa, x, w, out, n_tokens),
            CpuKernels::Fast(isa) if fast::has_float_kernel(w.ty) => self.matmul_float(isa, x, w, out, n_tokens),
            _ => self.matmul_reference(x, w, out, n_tokens),
        }
        Ok(())
    }

    fn rope(
        &self,
        x: BlockHandle,
        positions: BlockHandle,
        freqs: BlockHandle,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<()> {
        disjoint(&[x], &[positions, freqs])?;
        let x = self.view_mut(x, n_tokens * n_heads * head_dim);
        let freqs = self.view(freqs, rope.dims / 2);
        kernels::rope::rope(x, self.view(positions, n_tokens), freqs, n_heads, head_dim, rope);
        Ok(())
    }

    fn add_bias(&self, x: BlockHandle, bias: BlockHandle, n_tokens: usize, width: usize) -> Result<()> {
        disjoint(&[x], &[bias])?;
        kernels::add::add_bias(self.view_mut(x, n_tokens * width), self.view(bias, width));
        Ok(())
    }

    fn kv_write(
        &self,
        k: BlockHandle,
        v: BlockHandle,
        AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            ..
        }: AttentionKv<'_, ()>,
        n_tokens: usize,
        kv_width: usize,
    ) -> Result<()> {
        disjoint(
            &[k_cache, v_cache],
            &[k, v, positions, pages.block_tables, pages.token_seqs],
        )?;
        let positions = self.view::<u32>(positions, n_tokens);
        let (map, cache_len) = self.page_map(pages, positions, k_cache, v_cache, kv_width)?;
        let n = n_tokens * kv_width;
        let (k, v) = (self.view::<f32>(k, n), self.view::<f32>(v, n));
        match self.kv_type {
            KvType::F32 => kernels::kv_write::kv_write(
                k,
                v,
                self.view_mut(k_cache, cache_len),
                self.view_mut(v_cache, cache_len),
                positions,
                &map,
                kv_width,
            ),
            KvType::F16 => {
                use fast::attention::KvElem;
                let (kc, vc) = (
                    self.view_mut::<f16>(k_cache, cache_len),
                    self.view_mut::<f16>(v_cache, cache_len),
                );
                for (t, &pos) in positions.iter().enumerate() {
                    let (src, dst) = (t * kv_width..(t + 1) * kv_width, map.row(t, pos as usize) * kv_width);
                    f16::store(&k[src.clone()], &mut kc[dst..dst + kv_width]);
                    f16::store(&v[src], &mut vc[dst..dst + kv_width]);
                }
            }
        }
        Ok(())
    }

    fn plan_step(&self, _: StepLayout, _: AttentionShape) -> Result<()> {
        Ok(())
    }

    fn attention(
        &self,
        q: BlockHandle,
        AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores,
            ..
        }: AttentionKv<'_, ()>,
        out: BlockHandle,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        disjoint(
            &[out],
            &[q, k_cache, v_cache, positions, pages.block_tables, pages.token_seqs],
        )?;
        // Refuses the rules the GPU backends refuse (a window of nothing, a cap that is no cap).
        scores.kernel_args()?;
        let positions = self.view::<u32>(positions, n_tokens);
        let (map, cache_len) = self.page_map(pages, positions, k_cache, v_cache, shape.kv_width())?;
        let n = n_tokens * shape.q_width();
        let (q, out) = (self.view::<f32>(q, n), self.view_mut::<f32>(out, n));
        let (k, v) = (k_cache, v_cache);
        match (self.kernels, self.kv_type) {
            (CpuKernels::Reference, _) => kernels::attention::attention(
                q,
                self.view(k, cache_len),
                self.view(v, cache_len),
                positions,
                &map,
                out,
                shape,
                scores,
            ),
            (CpuKernels::Fast(isa), KvType::F32) => {
                let (k, v) = (self.view::<f32>(k, cache_len), self.view::<f32>(v, cache_len));
                self.attention_fast(isa, q, k, v, positions, &map, out, shape, scores)
            }
            (CpuKernels::Fast(isa), KvType::F16) => {
                let (k, v) = (self.view::<f16>(k, cache_len), self.view::<f16>(v, cache_len));
                self.attention_fast(isa, q, k, v, positions, &map, out, shape, scores)
            }
        }
        Ok(())
    }

    fn glu(&self, gate: BlockHandle, up: BlockHandle, out: BlockHandle, n: usize, act: Activation) -> Result<()> {
        disjoint(&[out], &[gate, up])?;
        kernels::glu::glu(self.view(gate, n), self.view(up, n), self.view_mut(out, n), act);
        Ok(())
    }

    fn argmax(
        &self,
        x: BlockHandle,
        out: BlockHandle,
        n_rows: usize,
        width: usize,
        allowed: Option<BlockHandle>,
    ) -> Result<()> {
        disjoint(&[out], &[x])?;
        let x = self.view::<f32>(x, n_rows * width);
        let out = self.view_mut::<u32>(out, n_rows);
        match allowed {
            None => {
                for (o, row) in out.iter_mut().zip(x.chunks_exact(width)) {
                    *o = kernels::argmax::argmax(row);
                }
            }
            Some(allowed) => {
                let words = width.div_ceil(32);
                let allowed = self.view::<u32>(allowed, n_rows * words);
                for ((o, row), allowed) in out
                    .iter_mut()
                    .zip(x.chunks_exact(width))
                    .zip(allowed.chunks_exact(words))
                {
                    *o = kernels::argmax::argmax_within(row, allowed);
                }
            }
        }
        Ok(())
    }

    super::choices_at_once!();

    fn route(&self, logits: BlockHandle, routes: Routes, n_tokens: usize, routing: Routing) -> Result<()> {
        disjoint(&[routes.ids, routes.weights], &[logits])?;
        routing.check(&routes)?;
        let n = n_tokens * routing.k;
        kernels::route::route(
            self.view(logits, n_tokens * routing.n_experts),
            routing,
            self.view_mut(routes.ids, n),
            self.view_mut(routes.weights, n),
        );
        Ok(())
    }

    fn experts(
        &self,
        x: BlockHandle,
        set: ExpertSet<'_, CpuWeight>,
        routes: Routes,
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let ExpertScratch {
            rows,
            gate,
            up,
            hidden,
            out,
            groups: _,
        } = scratch;
        disjoint(
            &[residual, rows, gate, up, hidden, out],
            &[x, routes.ids, routes.weights],
        )?;
        let (dim, width) = set.shape()?;
        let n = n_tokens * routes.k;
        let (ids, weights) = (self.view::<u32>(routes.ids, n), self.view::<f32>(routes.weights, n));
        if let Some(bad) = ids.iter().find(|&&e| e as usize >= set.n_experts()) {
            return Err(Error::Backend(format!(
                "expert {bad} chosen of {} experts",
                set.n_experts()
            )));
        }
        match self.kernels {
            CpuKernels::Reference => {
                fn matrix(w: &CpuWeight) -> kernels::experts::ExpertMatrix<'_> {
                    kernels::experts::ExpertMatrix {
                        ty: w.ty,
                        bytes: w.bytes(),
                        n_in: w.n_in,
                        n_out: w.n_out,
                    }
                }
                let experts: Vec<kernels::experts::Expert> = (0..set.n_experts())
                    .map(|e| kernels::experts::Expert {
                        gate: matrix(&set.gate[e]),
                        up: matrix(&set.up[e]),
                        down: matrix(&set.down[e]),
                    })
                    .collect();
                kernels::experts::experts(
                    self.view(x, n_tokens * dim),
                    &experts,
                    ids,
                    weights,
                    routes.k,
                    set.activation,
                    self.view_mut(residual, n_tokens * dim),
                );
                Ok(())
            }
            CpuKernels::Fast(_) => {
                self.experts_grouped(x, set, ids, weights, scratch, residual, n_tokens, (dim, width))
            }
        }
    }

    fn add_gated(
        &self,
        x: BlockHandle,
        rows: BlockHandle,
        gates: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()> {
        disjoint(&[x], &[rows, gates])?;
        let n = n_tokens * width;
        kernels::add::add_gated(
            self.view_mut(x, n),
            self.view(rows, n),
            self.view(gates, n_tokens),
            width,
        );
        Ok(())
    }

    fn add(&self, x: BlockHandle, y: BlockHandle, n: usize) -> Result<()> {
        disjoint(&[x], &[y])?;
        kernels::add::add(self.view_mut(x, n), self.view(y, n));
        Ok(())
    }

    fn scale(&self, x: BlockHandle, factor: f32, n: usize) -> Result<()> {
        kernels::scale::scale(self.view_mut(x, n), factor);
        Ok(())
    }

    fn softcap(&self, x: BlockHandle, cap: f32, n: usize) -> Result<()> {
        kernels::scale::softcap(self.view_mut(x, n), cap);
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn matmul_many(&self, x: Input, ws: &[&CpuWeight], outs: &[BlockHandle], n_tokens: usize) -> Result<()> {
        let n_in = ws.first().map_or(0, |w| w.n_in);
        let x = self.input_rows(x, n_tokens, n_in)?;
        let shared = ws.iter().all(|w| w.n_in == n_in && fast::has_int8_kernel(w.ty));
        let isa = match self.kernels {
            CpuKernels::Fast(isa) if shared => isa,
            _ => {
                return ws
                    .iter()
                    .zip(outs)
                    .try_for_each(|(w, &out)| self.matmul(x, w, out, n_tokens))
            }
        };
        disjoint(outs, &[x])?;
        // One quantization of the shared input for all the weights.
        self.quantize_activations(isa, self.view::<f32>(x, n_tokens * n_in), n_in, n_tokens);
        for (w, &out) in ws.iter().zip(outs) {
            self.matmul_quantized(isa, w, self.view_mut::<f32>(out, n_tokens * w.n_out), n_tokens);
        }
        Ok(())
    }
}

// Instruction-set dispatch for the fast kernels.

/// The staged (portable) path: `out[t * n_out + row0 + slot]` for the staged rows.
fn dot_rows(stage: &Stage, rows: usize, x: &Q8Activations, out: OutPtr, n_out: usize, row0: usize) {
    let mut values = [0f32; 64];
    for slot in 0..rows {
        for t0 in (0..x.n_tokens).step_by(values.len()) {
            let n = (x.n_tokens - t0).min(values.len());
            fast::portable::dot_row(stage, slot, x, t0, &mut values[..n]);
            for (t, &v) in values[..n].iter().enumerate() {
                // SAFETY: `out` holds `[x.n_tokens, n_out]` and these rows belong to the caller.
                unsafe { *out.get().add((t0 + t) * n_out + row0 + slot) = v };
            }
        }
    }
}

fn quantize_row(isa: Isa, x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    match isa {
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { fast::avx512::quantize_row(x, q, d, s) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fast::avx2::quantize_row(x, q, d, s) },
        _ => fast::quantize_row(x, q, d, s),
    }
}

fn float_row(isa: Isa, ty: GgmlType, w: &[u8], n_in: usize, row: usize, out: &mut [f32]) {
    match isa {
        // FP8 is decoded through a table, which the vector code does not speed up.
        _ if ty == GgmlType::Fp8 => fast::portable::float_row(ty, w, n_in, row, out),
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { fast::avx512::float_row(ty, w, n_in, row, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fast::avx2::float_row(ty, w, n_in, row, out) },
        _ => fast::portable::float_row(ty, w, n_in, row, out),
    }
}

fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { fast::avx512::dot_f32(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fast::avx2::dot_f32(a, b) },
        _ => kernels::dot(a, b),
    }
}
