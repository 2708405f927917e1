//! axiom's Metal kernels (`crates/axiom/src/backend/metal/kernels/*.metal`), compiled as C++20
//! against a small `metal_stdlib` shim and run on the CPU, one fiber per GPU thread (see
//! `shim/launch.h`). There is no Mac here: this is how the MSL is tested against the CPU
//! reference on Linux (`tests/kernels.rs`). Each function launches one kernel with the grid the
//! Metal backend uses; the caller picks the threadgroup size, as `threadExecutionWidth` and
//! `maxTotalThreadsPerThreadgroup` would on a GPU.
//!
//! Buffers are plain slices: the kernels read and write them in place, as they would a shared
//! MTLBuffer. The functions check lengths first, so a wrong call panics here rather than
//! corrupting memory in C++.

use std::ffi::c_void;

/// Threads in a simdgroup, as on Apple GPUs.
pub const SIMD_WIDTH: u32 = 32;

/// The block tables of a step (see axiom's `PagedKv`).
#[derive(Clone, Copy)]
pub struct Pages<'a> {
    pub positions: &'a [u32],
    pub tables: &'a [u32],
    pub table_width: u32,
    pub token_seqs: &'a [u32],
    pub page_size: u32,
}

/// How attention weighs what a token sees (axiom's `Scores`): scores `scale * q.k`, capped to
/// `softcap * tanh(s / softcap)` unless `softcap` is 0, over the last `window` positions up to
/// the token's own (all of them where `window` is 0).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub scale: f32,
    pub softcap: f32,
    pub window: u32,
}

#[repr(C)]
struct Paged {
    positions: *const u32,
    tables: *const u32,
    table_width: u32,
    token_seqs: *const u32,
    page_size: u32,
}

impl Pages<'_> {
    /// Checks that every position's page is in the tables and the cache has `cache_rows` rows.
    fn ffi(&self, n_tokens: usize, cache_rows: usize) -> Paged {
        assert!(self.positions.len() >= n_tokens && self.token_seqs.len() >= n_tokens);
        for t in 0..n_tokens {
            let table = &self.tables[self.token_seqs[t] as usize * self.table_width as usize..];
            let pos = self.positions[t];
            for p in 0..=pos {
                let page = table[(p / self.page_size) as usize];
                assert!(
                    ((page + 1) * self.page_size) as usize <= cache_rows,
                    "page {page} outside the cache"
                );
            }
        }
        Paged {
            positions: self.positions.as_ptr(),
            tables: self.tables.as_ptr(),
            table_width: self.table_width,
            token_seqs: self.token_seqs.as_ptr(),
            page_size: self.page_size,
        }
    }
}

/// A KV cache layer: f32 values or f16 bits.
pub enum Cache<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [u16]),
}

impl Cache<'_> {
    fn parts(&mut self) -> (u32, *mut c_void, usize) {
        match self {
            Cache::F32(c) => (0, c.as_mut_ptr().cast(), c.len()),
            Cache::F16(c) => (1, c.as_mut_ptr().cast(), c.len()),
        }
    }
}

unsafe extern "C" {
    fn msl_matmul(
        ty: u32,
        w: *const u8,
        x: *const f32,
        g: *const f32,
        eps: f32,
        normed: u32,
        out: *mut f32,
        n_in: u32,
        n_out: u32,
        n_tokens: u32,
        accumulate: u32,
        simds: u32,
    ) -> i32;
    fn msl_matmul_glu(
        ty: u32,
        w_gate: *const u8,
        w_up: *const u8,
        x: *const f32,
        g: *const f32,
        eps: f32,
        normed: u32,
        out: *mut f32,
        n_in: u32,
        n_out: u32,
        n_tokens: u32,
        act: u32,
        simds: u32,
    ) -> i32;
    fn msl_matmul_tiled(
        ty: u32,
        w: *const u8,
        x: *const f32,
        out: *mut f32,
        n_in: u32,
        n_out: u32,
        n_tokens: u32,
        accumulate: u32,
    ) -> i32;
    fn msl_embed(
        ty: u32,
        table: *const u8,
        ids: *const u32,
        out: *mut f32,
        dim: u32,
        n_tokens: u32,
        threads: u32,
    ) -> i32;
    fn msl_rms_norm(x: *const f32, w: *const f32, out: *mut f32, dim: u32, eps: f32, rows: u32, threads: u32);
    fn msl_rope_kv_write(
        f16: u32,
        q: *mut f32,
        k: *mut f32,
        v: *const f32,
        k_cache: *mut c_void,
        v_cache: *mut c_void,
        freqs: *const f32,
        pages: Paged,
        n_tokens: u32,
        n_heads: u32,
        n_kv_heads: u32,
        head_dim: u32,
        dims: u32,
        halves: u32,
        scale: f32,
        threads: u32,
    );
    fn msl_rope(
        x: *mut f32,
        positions: *const u32,
        freqs: *const f32,
        n_tokens: u32,
        n_heads: u32,
        head_dim: u32,
        dims: u32,
        halves: u32,
        scale: f32,
        threads: u32,
    );
    fn msl_kv_write(
        f16: u32,
        k: *const f32,
        v: *const f32,
        k_cache: *mut c_void,
        v_cache: *mut c_void,
        pages: Paged,
        n_tokens: u32,
        kv_width: u32,
        threads: u32,
    );
    fn msl_attention(
        f16: u32,
        q: *const f32,
        k_cache: *const c_void,
        v_cache: *const c_void,
        pages: Paged,
        out: *mut f32,
        n_tokens: u32,
        n_heads: u32,
        n_kv_heads: u32,
        head_dim: u32,
        rule: Rule,
        simds: u32,
    );
    fn msl_flash_attention(
        f16: u32,
        head_max: u32,
        q: *const f32,
        k_cache: *const c_void,
        v_cache: *const c_void,
        pages: Paged,
        out: *mut f32,
        n_tokens: u32,
        n_heads: u32,
        n_kv_heads: u32,
        head_dim: u32,
        rule: Rule,
    ) -> i32;
    fn msl_attention_qk(
        f16: u32,
        q: *const f32,
        k_cache: *const c_void,
        pages: Paged,
        scores: *mut f32,
        n_tokens: u32,
        n_heads: u32,
        n_kv_heads: u32,
        head_dim: u32,
        n_ctx: u32,
        rule: Rule,
        threads: u32,
    );
    fn msl_attention_pv(
        f16: u32,
        scores: *const f32,
        v_cache: *const c_void,
        pages: Paged,
        out: *mut f32,
        n_tokens: u32,
        n_heads: u32,
        n_kv_heads: u32,
        head_dim: u32,
        n_ctx: u32,
        threads: u32,
    );
    fn msl_glu(gate: *const f32, up: *const f32, out: *mut f32, n: u32, act: u32, threads: u32);
    fn msl_scale(x: *mut f32, n: u32, factor: f32, threads: u32);
    fn msl_softcap(x: *mut f32, n: u32, cap: f32, threads: u32);
    fn msl_add(x: *mut f32, y: *const f32, n: u32, threads: u32);
    fn msl_add_bias(x: *mut f32, bias: *const f32, n: u32, width: u32, threads: u32);
    fn msl_argmax(
        x: *const f32,
        allowed: *const u32,
        constrained: u32,
        out: *mut u32,
        width: u32,
        rows: u32,
        threads: u32,
    );
    fn msl_matmul_experts(
        ty: u32,
        w: *const u8,
        ids: *const u32,
        x: *const f32,
        out: *mut f32,
        n_in: u32,
        n_out: u32,
        expert_bytes: u32,
        n_experts: u32,
        per_x: u32,
        pairs: u32,
        simds: u32,
    ) -> i32;
    fn msl_matmul_glu_experts(
        ty: u32,
        w_gate: *const u8,
        w_up: *const u8,
        ids: *const u32,
        x: *const f32,
        out: *mut f32,
        n_in: u32,
        n_out: u32,
        expert_bytes: u32,
        n_experts: u32,
        per_x: u32,
        act: u32,
        pairs: u32,
        simds: u32,
    ) -> i32;
    fn msl_route(
        logits: *const f32,
        ids: *mut u32,
        weights: *mut f32,
        n_experts: u32,
        k: u32,
        renormalize: u32,
        n_tokens: u32,
    );
    fn msl_experts_sum(
        residual: *mut f32,
        rows: *const f32,
        weights: *const f32,
        n: u32,
        width: u32,
        k: u32,
        threads: u32,
    );
    fn msl_add_gated(x: *mut f32, rows: *const f32, gates: *const f32, n: u32, width: u32, threads: u32);
}

/// Head counts and sizes.
#[derive(Clone, Copy)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The RMS norm a row kernel takes on the way in: `x[t] / rms(x[t]) * weight`.
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
}

/// A norm's arguments: its weight (checked to hold a value per input), or `x` in its place, unread.
fn norm_args(norm: Option<Norm>, x: &[f32], n_in: usize) -> (*const f32, f32, u32) {
    match norm {
        Some(Norm { weight, eps }) => {
            assert_eq!(weight.len(), n_in, "a norm weight per input");
            (weight.as_ptr(), eps, 1)
        }
        None => (x.as_ptr(), 0.0, 0),
    }
}

/// `matmul_<type>`: `out[t, o] = sum_i x[t, i] * w[o, i]` (`+=` with `accumulate`), `w` in GGUF
/// type `ty` (its id) with `row_bytes` bytes per row, `x` normalized on the way in with `norm`;
/// `simds` rows per threadgroup.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ty: u32,
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    norm: Option<Norm>,
    out: &mut [f32],
    n_in: usize,
    n_tokens: usize,
    accumulate: bool,
    simds: u32,
) {
    let n_out = out.len() / n_tokens;
    assert!(w.len() >= n_out * row_bytes && x.len() >= n_tokens * n_in && out.len() == n_tokens * n_out);
    let (g, eps, normed) = norm_args(norm, x, n_in);
    // SAFETY: lengths checked above; the kernel reads `n_out` rows and `n_tokens` inputs.
    let rc = unsafe {
        msl_matmul(
            ty,
            w.as_ptr(),
            x.as_ptr(),
            g,
            eps,
            normed,
            out.as_mut_ptr(),
            n_in as u32,
            n_out as u32,
            n_tokens as u32,
            accumulate as u32,
            simds,
        )
    };
    assert_eq!(rc, 0, "no matmul kernel for type {ty}");
}

/// `matmul_glu_<type>`: `out = act(x w_gate^T) * (x w_up^T)`, `act` as axiom's
/// `Activation::code`, both weights in type `ty` with `row_bytes` bytes per row; `x` normalized
/// on the way in with `norm`; `simds` rows per threadgroup.
#[allow(clippy::too_many_arguments)]
pub fn matmul_glu(
    ty: u32,
    [w_gate, w_up]: [&[u8]; 2],
    row_bytes: usize,
    x: &[f32],
    norm: Option<Norm>,
    out: &mut [f32],
    n_in: usize,
    n_tokens: usize,
    act: u32,
    simds: u32,
) {
    let n_out = out.len() / n_tokens;
    assert!(w_gate.len() >= n_out * row_bytes && w_up.len() >= n_out * row_bytes);
    assert!(x.len() >= n_tokens * n_in && out.len() == n_tokens * n_out);
    let (g, eps, normed) = norm_args(norm, x, n_in);
    // SAFETY: lengths checked above; the kernel reads `n_out` rows of each weight and `n_tokens` inputs.
    let rc = unsafe {
        msl_matmul_glu(
            ty,
            w_gate.as_ptr(),
            w_up.as_ptr(),
            x.as_ptr(),
            g,
            eps,
            normed,
            out.as_mut_ptr(),
            n_in as u32,
            n_out as u32,
            n_tokens as u32,
            act,
            simds,
        )
    };
    assert_eq!(rc, 0, "no matmul_glu kernel for type {ty}");
}

/// `matmul_tiled_<type>`, the prompt matmul: as [`matmul`], in tiles of tokens by rows staged in
/// threadgroup memory and multiplied in simdgroup matrices (four simdgroups per tile).
#[allow(clippy::too_many_arguments)]
pub fn matmul_tiled(
    ty: u32,
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    out: &mut [f32],
    n_in: usize,
    n_tokens: usize,
    accumulate: bool,
) {
    let n_out = out.len() / n_tokens;
    assert!(w.len() >= n_out * row_bytes && x.len() >= n_tokens * n_in && out.len() == n_tokens * n_out);
    // SAFETY: lengths checked above; the kernel reads `n_out` rows and `n_tokens` inputs.
    let rc = unsafe {
        msl_matmul_tiled(
            ty,
            w.as_ptr(),
            x.as_ptr(),
            out.as_mut_ptr(),
            n_in as u32,
            n_out as u32,
            n_tokens as u32,
            accumulate as u32,
        )
    };
    assert_eq!(rc, 0, "no tiled matmul kernel for type {ty}");
}

/// `embed_<type>`: `out[t] = row ids[t]` of a table with `row_bytes` bytes per row of `dim`.
pub fn embed(ty: u32, table: &[u8], row_bytes: usize, ids: &[u32], out: &mut [f32], dim: usize, threads: u32) {
    assert!(ids.iter().all(|&id| (id as usize + 1) * row_bytes <= table.len()));
    assert_eq!(out.len(), ids.len() * dim);
    // SAFETY: every id's row is inside the table; `out` holds a row per id.
    let rc = unsafe {
        msl_embed(
            ty,
            table.as_ptr(),
            ids.as_ptr(),
            out.as_mut_ptr(),
            dim as u32,
            ids.len() as u32,
            threads,
        )
    };
    assert_eq!(rc, 0, "no embed kernel for type {ty}");
}

pub fn rms_norm(x: &[f32], w: &[f32], out: &mut [f32], dim: usize, eps: f32, threads: u32) {
    assert!(w.len() == dim && x.len() == out.len() && x.len().is_multiple_of(dim));
    let rows = (x.len() / dim) as u32;
    // SAFETY: `rows` rows of `dim` in `x` and `out`.
    unsafe { msl_rms_norm(x.as_ptr(), w.as_ptr(), out.as_mut_ptr(), dim as u32, eps, rows, threads) }
}

/// `rope_kv_write_<f16|f32>`: RoPE on `q` and `k` in place (cosine and sine times `scale`), then
/// `k` and `v` into the caches.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_write(
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    mut k_cache: Cache,
    mut v_cache: Cache,
    freqs: &[f32],
    pages: Pages,
    heads: Heads,
    dims: usize,
    halves: bool,
    scale: f32,
    threads: u32,
) {
    let kv_width = heads.n_kv_heads * heads.head_dim;
    let n_tokens = k.len() / kv_width;
    let (f16, kc, rows) = k_cache.parts();
    let (_, vc, _) = v_cache.parts();
    let paged = pages.ffi(n_tokens, rows / kv_width);
    assert!(q.len() == n_tokens * heads.n_heads * heads.head_dim && v.len() == k.len());
    assert!(freqs.len() >= dims / 2 && dims <= heads.head_dim);
    // SAFETY: sizes and pages checked above.
    unsafe {
        msl_rope_kv_write(
            f16,
            q.as_mut_ptr(),
            k.as_mut_ptr(),
            v.as_ptr(),
            kc,
            vc,
            freqs.as_ptr(),
            paged,
            n_tokens as u32,
            heads.n_heads as u32,
            heads.n_kv_heads as u32,
            heads.head_dim as u32,
            dims as u32,
            halves as u32,
            scale,
            threads,
        )
    }
}

/// `rope` on `[n_tokens, n_heads * head_dim]`; `halves` for the rotate-half pairing, cosine and
/// sine times `scale`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    freqs: &[f32],
    n_heads: usize,
    head_dim: usize,
    dims: usize,
    halves: bool,
    scale: f32,
    threads: u32,
) {
    let n_tokens = positions.len();
    assert!(x.len() == n_tokens * n_heads * head_dim && freqs.len() >= dims / 2 && dims <= head_dim);
    // SAFETY: sizes checked above.
    unsafe {
        msl_rope(
            x.as_mut_ptr(),
            positions.as_ptr(),
            freqs.as_ptr(),
            n_tokens as u32,
            n_heads as u32,
            head_dim as u32,
            dims as u32,
            halves as u32,
            scale,
            threads,
        )
    }
}

/// `kv_write_<f16|f32>` of `n_tokens` rows of `kv_width`.
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    k: &[f32],
    v: &[f32],
    mut k_cache: Cache,
    mut v_cache: Cache,
    pages: Pages,
    kv_width: usize,
    threads: u32,
) {
    let n_tokens = k.len() / kv_width;
    let (f16, kc, rows) = k_cache.parts();
    let (_, vc, _) = v_cache.parts();
    let paged = pages.ffi(n_tokens, rows / kv_width);
    assert_eq!(v.len(), k.len());
    // SAFETY: every written row is inside the caches (checked by `ffi`).
    unsafe {
        msl_kv_write(
            f16,
            k.as_ptr(),
            v.as_ptr(),
            kc,
            vc,
            paged,
            n_tokens as u32,
            kv_width as u32,
            threads,
        )
    }
}

/// The fused one-pass `attention_<f16|f32>`, `simds` simdgroups per (token, head).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    mut k_cache: Cache,
    mut v_cache: Cache,
    pages: Pages,
    out: &mut [f32],
    heads: Heads,
    rule: Rule,
    simds: u32,
) {
    let n_tokens = out.len() / (heads.n_heads * heads.head_dim);
    let (f16, kc, rows) = k_cache.parts();
    let (_, vc, _) = v_cache.parts();
    let paged = pages.ffi(n_tokens, rows / (heads.n_kv_heads * heads.head_dim));
    assert_eq!(q.len(), out.len());
    // SAFETY: sizes and pages checked above.
    unsafe {
        msl_attention(
            f16,
            q.as_ptr(),
            kc,
            vc,
            paged,
            out.as_mut_ptr(),
            n_tokens as u32,
            heads.n_heads as u32,
            heads.n_kv_heads as u32,
            heads.head_dim as u32,
            rule,
            simds,
        )
    }
}

/// The head-dim classes of the prompt attention (`flash_attention_<f16|f32>_<class>`): a head
/// runs in any class at least its size, padded.
pub const FLASH_HEAD_CLASSES: [usize; 3] = [64, 128, 256];

/// The prompt attention, `flash_attention_<f16|f32>_<head_max>`: tiles of 32 tokens by one head,
/// keys and values streamed through threadgroup memory, four simdgroups per tile.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    q: &[f32],
    mut k_cache: Cache,
    mut v_cache: Cache,
    pages: Pages,
    out: &mut [f32],
    heads: Heads,
    rule: Rule,
    head_max: usize,
) {
    let n_tokens = out.len() / (heads.n_heads * heads.head_dim);
    let (f16, kc, rows) = k_cache.parts();
    let (_, vc, _) = v_cache.parts();
    let paged = pages.ffi(n_tokens, rows / (heads.n_kv_heads * heads.head_dim));
    assert!(q.len() == out.len() && heads.head_dim <= head_max);
    // SAFETY: sizes and pages checked above.
    let rc = unsafe {
        msl_flash_attention(
            f16,
            head_max as u32,
            q.as_ptr(),
            kc,
            vc,
            paged,
            out.as_mut_ptr(),
            n_tokens as u32,
            heads.n_heads as u32,
            heads.n_kv_heads as u32,
            heads.head_dim as u32,
            rule,
        )
    };
    assert_eq!(rc, 0, "no flash attention kernel for heads of up to {head_max}");
}

/// The two-pass attention's first pass, `attention_qk_<f16|f32>`: scores `[n_tokens * n_heads, n_ctx]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_qk(
    q: &[f32],
    mut k_cache: Cache,
    pages: Pages,
    scores: &mut [f32],
    heads: Heads,
    n_ctx: usize,
    rule: Rule,
    threads: u32,
) {
    let n_tokens = q.len() / (heads.n_heads * heads.head_dim);
    let (f16, kc, rows) = k_cache.parts();
    let paged = pages.ffi(n_tokens, rows / (heads.n_kv_heads * heads.head_dim));
    assert!(scores.len() == n_tokens * heads.n_heads * n_ctx);
    assert!(pages.positions[..n_tokens].iter().all(|&p| (p as usize) < n_ctx));
    // SAFETY: sizes and pages checked above.
    unsafe {
        msl_attention_qk(
            f16,
            q.as_ptr(),
            kc,
            paged,
            scores.as_mut_ptr(),
            n_tokens as u32,
            heads.n_heads as u32,
            heads.n_kv_heads as u32,
            heads.head_dim as u32,
            n_ctx as u32,
            rule,
            threads,
        )
    }
}

/// The two-pass attention's second pass, `attention_pv_<f16|f32>`: softmax of the scores, times the values.
/// `threads` must be a power of two.
#[allow(clippy::too_many_arguments)]
pub fn attention_pv(
    scores: &[f32],
    mut v_cache: Cache,
    pages: Pages,
    out: &mut [f32],
    heads: Heads,
    n_ctx: usize,
    threads: u32,
) {
    let n_tokens = out.len() / (heads.n_heads * heads.head_dim);
    let (f16, vc, rows) = v_cache.parts();
    let paged = pages.ffi(n_tokens, rows / (heads.n_kv_heads * heads.head_dim));
    assert!(scores.len() == n_tokens * heads.n_heads * n_ctx && threads.is_power_of_two() && threads <= 1024);
    // SAFETY: sizes and pages checked above.
    unsafe {
        msl_attention_pv(
            f16,
            scores.as_ptr(),
            vc,
            paged,
            out.as_mut_ptr(),
            n_tokens as u32,
            heads.n_heads as u32,
            heads.n_kv_heads as u32,
            heads.head_dim as u32,
            n_ctx as u32,
            threads,
        )
    }
}

/// `glu`: `out = act(gate) * up`, `act` as axiom's `Activation::code`.
pub fn glu(gate: &[f32], up: &[f32], out: &mut [f32], act: u32, threads: u32) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    // SAFETY: three slices of one length.
    unsafe {
        msl_glu(
            gate.as_ptr(),
            up.as_ptr(),
            out.as_mut_ptr(),
            out.len() as u32,
            act,
            threads,
        )
    }
}

pub fn scale(x: &mut [f32], factor: f32, threads: u32) {
    // SAFETY: one slice, its length passed.
    unsafe { msl_scale(x.as_mut_ptr(), x.len() as u32, factor, threads) }
}

pub fn softcap(x: &mut [f32], cap: f32, threads: u32) {
    // SAFETY: one slice, its length passed.
    unsafe { msl_softcap(x.as_mut_ptr(), x.len() as u32, cap, threads) }
}

pub fn add(x: &mut [f32], y: &[f32], threads: u32) {
    assert_eq!(x.len(), y.len());
    // SAFETY: two slices of one length.
    unsafe { msl_add(x.as_mut_ptr(), y.as_ptr(), x.len() as u32, threads) }
}

pub fn add_bias(x: &mut [f32], bias: &[f32], threads: u32) {
    assert!(x.len().is_multiple_of(bias.len()));
    // SAFETY: whole rows of `bias.len()`.
    unsafe {
        msl_add_bias(
            x.as_mut_ptr(),
            bias.as_ptr(),
            x.len() as u32,
            bias.len() as u32,
            threads,
        )
    }
}

/// `argmax` of each row of `x` (`out.len()` rows), within `allowed` (`width.div_ceil(32)` words a
/// row) where given.
pub fn argmax(x: &[f32], allowed: Option<&[u32]>, out: &mut [u32], threads: u32) {
    let width = x.len() / out.len();
    assert_eq!(x.len(), width * out.len());
    let (bits, constrained) = match allowed {
        Some(bits) => {
            assert_eq!(bits.len(), width.div_ceil(32) * out.len());
            (bits.as_ptr(), 1)
        }
        None => (std::ptr::null(), 0),
    };
    // SAFETY: `out.len()` rows of `width`, and of their words where constrained.
    unsafe {
        msl_argmax(
            x.as_ptr(),
            bits,
            constrained,
            out.as_mut_ptr(),
            width as u32,
            out.len() as u32,
            threads,
        )
    }
}

/// `route`: each row of `logits` (`n_experts` wide) to its `k` experts, `ids` and `weights`
/// holding `[n_tokens, k]`; one simdgroup per token.
pub fn route(logits: &[f32], n_experts: usize, k: usize, renormalize: bool, ids: &mut [u32], weights: &mut [f32]) {
    let n_tokens = logits.len() / n_experts;
    assert!(logits.len() == n_tokens * n_experts && ids.len() == n_tokens * k && weights.len() == n_tokens * k);
    assert!(k >= 1 && k <= n_experts, "routing to {k} of {n_experts} experts");
    // SAFETY: `n_tokens` rows of logits, ids and weights, checked above.
    unsafe {
        msl_route(
            logits.as_ptr(),
            ids.as_mut_ptr(),
            weights.as_mut_ptr(),
            n_experts as u32,
            k as u32,
            renormalize as u32,
            n_tokens as u32,
        )
    }
}

/// One matrix of every expert, stacked as axiom's Metal `upload_experts` stacks them: `n_experts`
/// matrices of `n_out` rows of `n_in`, in GGUF type `ty` (its id), `row_bytes` bytes per row.
#[derive(Clone, Copy)]
pub struct ExpertStack<'a> {
    pub ty: u32,
    pub bytes: &'a [u8],
    pub row_bytes: usize,
    pub n_in: usize,
    pub n_out: usize,
}

impl ExpertStack<'_> {
    fn n_experts(&self) -> usize {
        self.bytes.len() / (self.n_out * self.row_bytes)
    }
}

/// `matmul_experts_<type>`: `out[p] = stack[ids[p]] x[p / per_x]` for every pair `p` of `ids`
/// (an id outside the stack writes NaN); `simds` rows per threadgroup.
pub fn matmul_experts(stack: ExpertStack, ids: &[u32], x: &[f32], per_x: usize, out: &mut [f32], simds: u32) {
    let (pairs, expert_bytes) = (ids.len(), stack.n_out * stack.row_bytes);
    assert_eq!(stack.bytes.len(), stack.n_experts() * expert_bytes, "whole experts");
    assert!(x.len() >= pairs.div_ceil(per_x) * stack.n_in && out.len() == pairs * stack.n_out);
    // SAFETY: lengths checked above; the kernel reads only experts below n_experts.
    let rc = unsafe {
        msl_matmul_experts(
            stack.ty,
            stack.bytes.as_ptr(),
            ids.as_ptr(),
            x.as_ptr(),
            out.as_mut_ptr(),
            stack.n_in as u32,
            stack.n_out as u32,
            expert_bytes as u32,
            stack.n_experts() as u32,
            per_x as u32,
            pairs as u32,
            simds,
        )
    };
    assert_eq!(rc, 0, "no expert matmul kernel for type {}", stack.ty);
}

/// `matmul_glu_experts_<type>`: `out[p] = act(gate[ids[p]] x[p / per_x]) * (up[ids[p]] x[p / per_x])`,
/// both stacks of one type and shape; `simds` rows per threadgroup.
pub fn matmul_glu_experts(
    [gate, up]: [ExpertStack; 2],
    ids: &[u32],
    x: &[f32],
    per_x: usize,
    act: u32,
    out: &mut [f32],
    simds: u32,
) {
    let (pairs, expert_bytes) = (ids.len(), gate.n_out * gate.row_bytes);
    assert!(gate.ty == up.ty && gate.n_in == up.n_in && gate.n_out == up.n_out && gate.bytes.len() == up.bytes.len());
    assert_eq!(gate.bytes.len(), gate.n_experts() * expert_bytes, "whole experts");
    assert!(x.len() >= pairs.div_ceil(per_x) * gate.n_in && out.len() == pairs * gate.n_out);
    // SAFETY: lengths checked above; the kernel reads only experts below n_experts.
    let rc = unsafe {
        msl_matmul_glu_experts(
            gate.ty,
            gate.bytes.as_ptr(),
            up.bytes.as_ptr(),
            ids.as_ptr(),
            x.as_ptr(),
            out.as_mut_ptr(),
            gate.n_in as u32,
            gate.n_out as u32,
            expert_bytes as u32,
            gate.n_experts() as u32,
            per_x as u32,
            act,
            pairs as u32,
            simds,
        )
    };
    assert_eq!(rc, 0, "no expert matmul kernel for type {}", gate.ty);
}

/// The experts' gated feed-forward blocks.
#[derive(Clone, Copy)]
pub struct Experts<'a> {
    pub gate: ExpertStack<'a>,
    pub up: ExpertStack<'a>,
    pub down: ExpertStack<'a>,
    /// The gate's activation, as axiom's `Activation::code`.
    pub act: u32,
}

/// The whole expert op as axiom's Metal `experts` encodes it: for each (token, choice) pair of
/// `ids`, `matmul_glu_experts` of the gate and up matrices where they are of one type
/// (`matmul_experts` of each and `glu` otherwise), `matmul_experts` of the down matrices, then
/// `experts_sum` of the pairs' rows, weighted, into `residual` (`k` choices a token); scratch
/// rows start as NaN.
pub fn experts(experts: Experts, x: &[f32], ids: &[u32], weights: &[f32], k: usize, residual: &mut [f32], simds: u32) {
    let (dim, width, pairs) = (experts.gate.n_in, experts.gate.n_out, ids.len());
    assert!(weights.len() == pairs && residual.len() == pairs / k * dim);
    let (mut gate, mut up, mut hidden) = (
        vec![f32::NAN; pairs * width],
        vec![f32::NAN; pairs * width],
        vec![f32::NAN; pairs * width],
    );
    let mut rows = vec![f32::NAN; pairs * dim];
    if experts.gate.ty == experts.up.ty {
        matmul_glu_experts([experts.gate, experts.up], ids, x, k, experts.act, &mut hidden, simds);
    } else {
        matmul_experts(experts.gate, ids, x, k, &mut gate, simds);
        matmul_experts(experts.up, ids, x, k, &mut up, simds);
        glu(&gate, &up, &mut hidden, experts.act, 256);
    }
    matmul_experts(experts.down, ids, &hidden, 1, &mut rows, simds);
    // SAFETY: `pairs / k` rows of `dim` in residual, `pairs` rows of `dim` and `pairs` weights.
    unsafe {
        msl_experts_sum(
            residual.as_mut_ptr(),
            rows.as_ptr(),
            weights.as_ptr(),
            residual.len() as u32,
            dim as u32,
            k as u32,
            256,
        )
    }
}

/// `add_gated`: `x[t] += sigmoid(gates[t]) * rows[t]`, rows of `x.len() / gates.len()`.
pub fn add_gated(x: &mut [f32], rows: &[f32], gates: &[f32], threads: u32) {
    let width = x.len() / gates.len();
    assert!(x.len() == width * gates.len() && rows.len() == x.len());
    // SAFETY: `gates.len()` rows of `width` in `x` and `rows`.
    unsafe {
        msl_add_gated(
            x.as_mut_ptr(),
            rows.as_ptr(),
            gates.as_ptr(),
            x.len() as u32,
            width as u32,
            threads,
        )
    }
}
