//! Every kernel's parameters as one `#[repr(C)]` struct, passed by value (one kernel parameter, in
//! the kernel's constant bank), laid out as its twin of the same name in kernels/params.cuh: device
//! pointers as u64, `int` as i32. `layouts` gives tests/cuda_nvrtc.rs what to compare them with.

use super::matmul::MAX_MATRICES;

/// A parameter struct as Rust lays it out: its size, and each field's offset and size.
pub struct Layout {
    pub name: &'static str,
    pub size: usize,
    pub fields: Vec<FieldLayout>,
}

pub struct FieldLayout {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
    /// Its Rust type, as written (`i32`, `[u64; MAX_MATRICES]`).
    pub ty: &'static str,
}

/// A kernel's parameter struct: `launch` passes it as the kernel's one argument, and refuses a
/// kernel whose name `kernel_params_of` gives another struct.
pub(super) trait KernelParams: Copy {
    const NAME: &'static str;
}

/// Declares each struct (`#[repr(C)]`, `Copy`, fields visible to the launchers) with the prefixes
/// of the names of the kernels that take it (`for [...]`), `layouts` and `kernel_params_of`.
macro_rules! kernel_params {
    ($(
        $(#[$meta:meta])*
        struct $name:ident for [$($kernel:literal),*] { $($field:ident: $ty:ty,)* }
    )*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub(super) struct $name {
                $(pub(super) $field: $ty,)*
            }
            impl KernelParams for $name {
                const NAME: &'static str = stringify!($name);
            }
        )*

        /// Every parameter struct's layout, by the name its CUDA twin has.
        pub fn layouts() -> Vec<Layout> {
            vec![$(Layout {
                name: stringify!($name),
                size: std::mem::size_of::<$name>(),
                fields: vec![$(FieldLayout {
                    name: stringify!($field),
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                    ty: stringify!($ty),
                }),*],
            }),*]
        }

        /// The struct kernel `name` takes, and its size: the struct with the longest prefix of
        /// `name` among its kernels' prefixes (`gemv_glu_normed_` before `gemv_`).
        pub fn kernel_params_of(name: &str) -> Option<(&'static str, usize)> {
            let structs: &[(&str, &[&str], usize)] = &[
                $((stringify!($name), &[$($kernel),*], std::mem::size_of::<$name>()),)*
            ];
            structs
                .iter()
                .flat_map(|&(params, prefixes, size)| prefixes.iter().map(move |p| (*p, params, size)))
                .filter(|(prefix, _, _)| name.starts_with(prefix))
                .max_by_key(|(prefix, _, _)| prefix.len())
                .map(|(_, params, size)| (params, size))
        }
    };
}

kernel_params! {
    /// embed_*: a weight's fields (`weight_ptrs`), then the ids and the f32 rows out.
    struct EmbedParams for ["embed_"] {
        q: u64,
        s: u64,
        m: u64,
        n_in: i32,
        ids: u64,
        out: u64,
    }

    struct RmsNormParams for ["rms_norm"] {
        x: u64,
        w: u64,
        out: u64,
        dim: i32,
        eps: f32,
    }

    /// `kind`: the 16-bit type's `GgmlType::id`.
    struct RmsNorm16Params for ["rms_norm_16"] {
        x: u64,
        w: u64,
        out: u64,
        dim: i32,
        eps: f32,
        kind: i32,
    }

    struct RmsNormFp8Params for ["rms_norm_16_fp8"] {
        x: u64,
        w: u64,
        out: u64,
        codes: u64,
        scales: u64,
        dim: i32,
        eps: f32,
        kind: i32,
        n_tokens: i32,
        cols: i32,
    }

    /// rms_norm_pair: rows of `x[0]` up to block `split`, of `x[1]` from there.
    struct RmsNormPairParams for ["rms_norm_pair"] {
        x: [u64; 2],
        w: [u64; 2],
        out: [u64; 2],
        split: u32,
        dim: i32,
        eps: f32,
    }

    /// rms_norm_q8, rms_norm_q8_1 and rms_norm_q8_rows (which also writes the f32 rows to
    /// `rows`; the others leave it).
    struct RmsNormQ8Params for ["rms_norm_q8"] {
        x: u64,
        w: u64,
        xq: u64,
        xd: u64,
        rows: u64,
        dim: i32,
        eps: f32,
        interleave: i32,
        start_next: i32,
    }

    struct RopeParams for ["rope"] {
        x: u64,
        positions: u64,
        freqs: u64,
        n_heads: i32,
        head_dim: i32,
        dims: i32,
        halves: i32,
        scale: f32,
    }

    /// Up to `MAX_MATRICES` weights of one type for one matrix-vector launch: their fields,
    /// outputs and rows.
    #[derive(Default)]
    struct Matrices for [] {
        q: [u64; MAX_MATRICES],
        s: [u64; MAX_MATRICES],
        m: [u64; MAX_MATRICES],
        out: [u64; MAX_MATRICES],
        n_out: [i32; MAX_MATRICES],
        count: i32,
        accumulate: i32,
        copy_whole: i32,
    }

    /// The matrix-vector kernels on f32 activations.
    struct GemvParams for ["gemv_"] {
        mats: Matrices,
        n_in: i32,
        x: u64,
    }

    /// The matrix-vector kernels on int8 activations and their f32 block scales.
    struct GemvIntParams for ["gemv_int_"] {
        mats: Matrices,
        n_in: i32,
        xq: u64,
        xd: u64,
    }

    /// The one-token matrix-vector kernels that RMS-normalize their input first.
    struct GemvNormedParams for ["gemv_normed_", "gemv_glu_normed_"] {
        mats: Matrices,
        n_in: i32,
        x: u64,
        norm: u64,
        eps: f32,
    }

    struct QuantizeQ8Params for ["quantize_q8"] {
        x: u64,
        xq: u64,
        xd: u64,
        n: u64,
        n_in: i32,
        interleave: i32,
        start_next: i32,
    }

    /// dequant_f16_*: a weight's fields, then its rows out in f16.
    struct DequantParams for ["dequant_f16_"] {
        q: u64,
        s: u64,
        m: u64,
        n_in: i32,
        out: u64,
        n_out: i32,
    }

    struct KvWriteParams for ["kv_write_"] {
        k: u64,
        v: u64,
        k_cache: u64,
        v_cache: u64,
        positions: u64,
        tables: u64,
        table_width: i32,
        token_seqs: u64,
        page_size: i32,
        width: i32,
    }

    /// `turns_out` is 0 unless the step is flash attention's (`rotate_and_store`).
    struct RopeKvWriteParams for ["rope_kv_write_"] {
        q: u64,
        k: u64,
        v: u64,
        k_cache: u64,
        v_cache: u64,
        positions: u64,
        freqs: u64,
        tables: u64,
        table_width: i32,
        token_seqs: u64,
        page_size: i32,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
        dims: i32,
        halves: i32,
        scale: f32,
        first_head: i32,
        group: i32,
        turns_out: u64,
    }

    /// The one-pass attention kernel: `k_new`, `v_new` and `freqs` are 0 unless it stores the
    /// step's token itself, `xq` and `xd` unless it quantizes its output too. `scale`, `softcap`
    /// and `window` as `ScoreArgs` gives them.
    struct AttentionParams for ["attention_"] {
        q: u64,
        k_cache: u64,
        v_cache: u64,
        positions: u64,
        tables: u64,
        table_width: i32,
        token_seqs: u64,
        page_size: i32,
        k_new: u64,
        v_new: u64,
        freqs: u64,
        dims: i32,
        halves: i32,
        rope_scale: f32,
        out: u64,
        xq: u64,
        xd: u64,
        interleave: i32,
        start_next: i32,
        partials: u64,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
        scale: f32,
        softcap: f32,
        window: i32,
    }

    /// Flash attention on either kind of MMA: `turns` is 0 unless it rotates the queries; the
    /// scores' fields as for `AttentionParams`.
    struct FlashAttentionParams for ["flash_attention", "flash_decode"] {
        q: u64,
        k_cache: u64,
        v_cache: u64,
        positions: u64,
        tables: u64,
        table_width: i32,
        token_seqs: u64,
        page_size: i32,
        tiles: u64,
        turns: u64,
        pairing: i32,
        out: u64,
        out_type: i32,
        n_heads: i32,
        n_kv_heads: i32,
        scale: f32,
        softcap: f32,
        window: i32,
    }

    struct GluParams for ["glu"] {
        gate: u64,
        up: u64,
        out: u64,
        n: u64,
        act: i32,
    }

    struct Glu16Params for ["glu_16"] {
        gate: u64,
        up: u64,
        out: u64,
        n: u64,
        kind: i32,
        act: i32,
    }

    struct ScaleParams for ["scale", "softcap"] {
        x: u64,
        n: u64,
        factor: f32,
    }

    struct AddParams for ["add"] {
        x: u64,
        y: u64,
        n: u64,
    }

    struct AddBiasParams for ["add_bias"] {
        x: u64,
        bias: u64,
        n: u64,
        width: u64,
    }

    /// quantize_fp8: `n_tokens` rows of `n_in` (f32 for `kind` 0, else 16-bit of that type) to
    /// E4M3 `codes` and `scales` in cuBLASLt's layout for `cols` tokens (fp8_gemm.rs).
    struct QuantizeFp8Params for ["quantize_fp8", "quantize_fp8_glu"] {
        x: u64,
        up: u64,
        codes: u64,
        scales: u64,
        n_tokens: i32,
        cols: i32,
        n_in: i32,
        kind: i32,
        act: i32,
    }

    struct ConvertF32Params for ["convert_f32"] {
        x: u64,
        out: u64,
        n: u64,
        kind: i32,
    }

    /// route: each token's router logits (`n_experts` a row) to its `k` expert ids and weights.
    struct RouteParams for ["route"] {
        logits: u64,
        ids: u64,
        weights: u64,
        n_tokens: i32,
        n_experts: i32,
        k: i32,
        renormalize: i32,
    }

    /// router_route_*: the router's rows (`n_in` each) by the tokens' rows `x`, into
    /// `route.logits`, then `route`; `done` counts the blocks finished (zero between launches).
    struct RouterRouteParams for ["router_route_"] {
        w: u64,
        x: u64,
        done: u64,
        n_in: i32,
        route: RouteParams,
    }

    /// One matrix of every expert of a layer (`upload_experts`): expert e's fields at `e` times
    /// each field's stride (bytes) from expert 0's.
    struct ExpertWeights for [] {
        q: u64,
        s: u64,
        m: u64,
        q_stride: u64,
        s_stride: u64,
        m_stride: u64,
    }

    /// The expert products: `w` (and with GLU `up`) of each pair's expert by its input row, into
    /// its output row. Pairwise, the pairs' experts are `ids` and pair i reads row
    /// `i / rows_per_token` of `x`; grouped, expert e's slots are `offsets[e]..offsets[e + 1]`
    /// of `x` and `out`. The int8 kernels (`expert_rows_int_glu`) read each token's row quantized, in
    /// `xq` and `xd`, instead of `x`; the tensor cores' (`expert_gemm_`) read 16-bit rows and
    /// write `out` in f32 or the 16 bits of `out_type` (a `GgmlType` id).
    struct ExpertProductParams for ["expert_rows_", "expert_groups_", "expert_gemm_"] {
        w: ExpertWeights,
        up: ExpertWeights,
        ids: u64,
        offsets: u64,
        x: u64,
        xq: u64,
        xd: u64,
        out: u64,
        n_in: i32,
        n_out: i32,
        n_experts: i32,
        rows_per_token: i32,
        act: i32,
        out_type: i32,
    }

    /// The down products of small steps fused with their weighted sum: pair i's expert `ids[i]`
    /// by row i of `x`, weighed by `weights[i]` and added to its token's row of `residual`, a
    /// block taking `groups` sets of rows of one token (expert_down_sum in kernels/experts.cu).
    /// The int8 kernels read the rows quantized, in `xq` and `xd`, instead of `x`.
    struct ExpertDownSumParams for ["expert_down_sum_"] {
        w: ExpertWeights,
        ids: u64,
        weights: u64,
        x: u64,
        xq: u64,
        xd: u64,
        residual: u64,
        n_in: i32,
        n_out: i32,
        n_experts: i32,
        k: i32,
        groups: i32,
    }

    /// group_pairs_*: the pairs' `ids` grouped by expert into `offsets` (`n_experts + 1`), `slots`
    /// (each pair's) and `pairs` (each slot's), by way of `counts` (each chunk's per expert).
    struct GroupPairsParams for ["group_pairs_"] {
        ids: u64,
        offsets: u64,
        slots: u64,
        pairs: u64,
        counts: u64,
        n_pairs: i32,
        n_experts: i32,
    }

    /// gather_pairs: `rows[s]` = row `pairs[s] / k` of `x` (`dim` values) for the grouped slots,
    /// in f32 or the 16 bits of `row_type` (a `GgmlType` id).
    struct GatherPairsParams for ["gather_pairs"] {
        x: u64,
        rows: u64,
        pairs: u64,
        offsets: u64,
        n_experts: i32,
        k: i32,
        dim: i32,
        row_type: i32,
    }

    /// experts_sum: each token's `k` expert rows of `out` (pair i's at row `slots[i]`, or i where
    /// `slots` is 0) weighed and added to its residual row.
    struct ExpertsSumParams for ["experts_sum"] {
        residual: u64,
        out: u64,
        ids: u64,
        weights: u64,
        slots: u64,
        n: u64,
        dim: i32,
        k: i32,
        n_experts: i32,
    }

    /// add_gated: `x[t] += sigmoid(gates[t]) * rows[t]` for rows of `width`.
    struct AddGatedParams for ["add_gated"] {
        x: u64,
        rows: u64,
        gates: u64,
        n: u64,
        width: u64,
    }

    /// `chosen`, `chosen_at` and `position` are 0 unless the choice is a queued greedy one;
    /// `allowed` is 0 unless the rows are constrained (`n.div_ceil(32)` words a row).
    struct ArgmaxParams for ["argmax"] {
        rows: u64,
        n: i32,
        allowed: u64,
        outs: u64,
        chosen: u64,
        chosen_at: u64,
        position: u64,
        keys: u64,
        arrivals: u64,
    }
}
