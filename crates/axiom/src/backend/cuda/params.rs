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
}

/// A kernel's parameter struct: `launch` passes it as the kernel's one argument.
pub(super) trait KernelParams: Copy {}

/// Declares each struct (`#[repr(C)]`, `Copy`, fields visible to the launchers) and `layouts`.
macro_rules! kernel_params {
    ($($(#[$meta:meta])* struct $name:ident { $($field:ident: $ty:ty,)* })*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub(super) struct $name {
                $(pub(super) $field: $ty,)*
            }
            impl KernelParams for $name {}
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
                }),*],
            }),*]
        }
    };
}

kernel_params! {
    /// embed_*: a weight's fields (`weight_ptrs`), then the ids and the f32 rows out.
    struct EmbedParams {
        q: u64,
        s: u64,
        m: u64,
        n_in: i32,
        ids: u64,
        out: u64,
    }

    struct RmsNormParams {
        x: u64,
        w: u64,
        out: u64,
        dim: i32,
        eps: f32,
    }

    /// `kind`: the 16-bit type's `GgmlType::id`.
    struct RmsNorm16Params {
        x: u64,
        w: u64,
        out: u64,
        dim: i32,
        eps: f32,
        kind: i32,
    }

    /// rms_norm_q8 and rms_norm_q8_1.
    struct RmsNormQ8Params {
        x: u64,
        w: u64,
        xq: u64,
        xd: u64,
        dim: i32,
        eps: f32,
        interleave: i32,
        start_next: i32,
    }

    struct RopeParams {
        x: u64,
        positions: u64,
        freqs: u64,
        n_heads: i32,
        head_dim: i32,
        dims: i32,
        halves: i32,
    }

    /// Up to `MAX_MATRICES` weights of one type for one matrix-vector launch: their fields,
    /// outputs and rows.
    #[derive(Default)]
    struct Matrices {
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
    struct GemvParams {
        mats: Matrices,
        n_in: i32,
        x: u64,
    }

    /// The matrix-vector kernels on int8 activations and their f32 block scales.
    struct GemvIntParams {
        mats: Matrices,
        n_in: i32,
        xq: u64,
        xd: u64,
    }

    /// The one-token matrix-vector kernels that RMS-normalize their input first.
    struct GemvNormedParams {
        mats: Matrices,
        n_in: i32,
        x: u64,
        norm: u64,
        eps: f32,
    }

    struct QuantizeQ8Params {
        x: u64,
        xq: u64,
        xd: u64,
        n: u64,
        n_in: i32,
        interleave: i32,
        start_next: i32,
    }

    /// dequant_f16_*: a weight's fields, then its rows out in f16.
    struct DequantParams {
        q: u64,
        s: u64,
        m: u64,
        n_in: i32,
        out: u64,
        n_out: i32,
    }

    struct KvWriteParams {
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
    struct RopeKvWriteParams {
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
        first_head: i32,
        group: i32,
        turns_out: u64,
    }

    /// The one-pass attention kernel: `k_new`, `v_new` and `freqs` are 0 unless it stores the
    /// step's token itself, `xq` and `xd` unless it quantizes its output too.
    struct AttentionParams {
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
        out: u64,
        xq: u64,
        xd: u64,
        interleave: i32,
        start_next: i32,
        partials: u64,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
    }

    /// Flash attention on either kind of MMA: `turns` is 0 unless it rotates the queries.
    struct FlashAttentionParams {
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
    }

    struct SwigluParams {
        gate: u64,
        up: u64,
        out: u64,
        n: u64,
    }

    struct Swiglu16Params {
        gate: u64,
        up: u64,
        out: u64,
        n: u64,
        kind: i32,
    }

    struct AddParams {
        x: u64,
        y: u64,
        n: u64,
    }

    struct AddBiasParams {
        x: u64,
        bias: u64,
        n: u64,
        width: u64,
    }

    struct ConvertF32Params {
        x: u64,
        out: u64,
        n: u64,
        kind: i32,
    }

    /// `chosen`, `chosen_at` and `position` are 0 unless the choice is a queued greedy one.
    struct ArgmaxParams {
        rows: u64,
        n: i32,
        outs: u64,
        chosen: u64,
        chosen_at: u64,
        position: u64,
        keys: u64,
        arrivals: u64,
    }
}
