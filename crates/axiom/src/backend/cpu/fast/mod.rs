//! The fast CPU matmul: activations quantized to 8-bit blocks, weights unpacked block by block
//! into 8-bit integers with a scale and an offset, and integer dot products (AVX-512 VNNI where
//! the CPU has it, portable code elsewhere). Float weights take an f32 path.
//!
//! Every weight type is brought to one "staged" form, 64 values at a time (a chunk): 64 unsigned
//! quants `u`, and for each group of four a scale `a` and offset `b`, so that the weight is
//! `a * u + b`. The activations of a chunk are 64 signed quants `q` with, per group of four, the
//! block scale `d` and `s = d * (sum of the four q)`. Then
//! `sum(w * x) = sum over groups of (a * d * dot(u, q) + b * s)`, which is what the
//! type-independent micro-kernels compute. Only the unpacking knows the block layouts.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod experts;
pub mod portable;
pub mod repack;

use crate::format::quant::GgmlType;

/// Values per staged chunk, and per group sharing a scale.
pub const CHUNK: usize = 64;
pub const GROUP: usize = 4;
pub const GROUPS_PER_CHUNK: usize = CHUNK / GROUP;

/// Weight types with an integer kernel; others use the float or reference path.
pub fn has_int8_kernel(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q4K | GgmlType::Q6K
    )
}

/// Float weights, and FP8 ones: E4M3's values times f32 scales are exact in f32 and not in 8-bit
/// integers, so their rows are converted to f32 like the float types'.
pub fn has_float_kernel(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Fp8)
}

/// The instruction set the kernels use, chosen once at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW/VL/DQ with VNNI.
    Avx512Vnni,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Plain Rust, correct on any architecture.
    Portable,
}

impl Isa {
    /// The best instruction set this CPU has, or the one `AXIOM_CPU_ISA` (portable, avx2,
    /// avx512) names if the CPU has it.
    pub fn detect() -> Isa {
        let available = Isa::available();
        let wanted = match std::env::var("AXIOM_CPU_ISA").as_deref() {
            Ok("portable") => Some(Isa::Portable),
            Ok("avx2") => Some(Isa::Avx2),
            Ok("avx512") => Some(Isa::Avx512Vnni),
            _ => None,
        };
        match wanted {
            Some(isa) if available.contains(&isa) => isa,
            #[allow(clippy::expect_used, reason = "the portable kernels are always in the list")]
            _ => *available.last().expect("portable is always available"),
        }
    }

    /// Every instruction set this CPU can run, from the most portable to the best.
    pub fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            let has = |f: &[bool]| f.iter().all(|&b| b);
            if has(&[
                is_x86_feature_detected!("avx2"),
                is_x86_feature_detected!("fma"),
                is_x86_feature_detected!("f16c"),
            ]) {
                isas.push(Isa::Avx2);
                if has(&[
                    is_x86_feature_detected!("avx512f"),
                    is_x86_feature_detected!("avx512bw"),
                    is_x86_feature_detected!("avx512vl"),
                    is_x86_feature_detected!("avx512dq"),
                    is_x86_feature_detected!("avx512vnni"),
                ]) {
                    isas.push(Isa::Avx512Vnni);
                }
            }
        }
        isas
    }
}

/// Activations of `n_tokens` rows of `n_in`, quantized for the integer kernels. Each row is
/// padded with zeros to whole chunks.
#[derive(Default)]
pub struct Q8Activations {
    pub n_tokens: usize,
    pub n_chunks: usize,
    /// `[n_tokens][n_chunks * CHUNK]` quants.
    pub q: Vec<i8>,
    /// `[n_tokens][n_chunks * GROUPS_PER_CHUNK]` block scale of each group.
    pub d: Vec<f32>,
    /// `[n_tokens][n_chunks * GROUPS_PER_CHUNK]` `d * sum(q)` of each group.
    pub s: Vec<f32>,
    /// `[n_tokens][n_chunks * 4]` `d * sum(q)` of each run of 16 (for the repacked kernels).
    pub s16: Vec<f32>,
}

impl Q8Activations {
    /// Sizes the buffers for `n_tokens` rows of `n_in` (reusing the allocation).
    pub fn resize(&mut self, n_tokens: usize, n_in: usize) {
        self.n_tokens = n_tokens;
        self.n_chunks = n_in.div_ceil(CHUNK);
        self.q.resize(n_tokens * self.n_chunks * CHUNK, 0);
        self.d.resize(n_tokens * self.n_chunks * GROUPS_PER_CHUNK, 0.0);
        self.s.resize(n_tokens * self.n_chunks * GROUPS_PER_CHUNK, 0.0);
        self.s16.resize(n_tokens * self.n_chunks * 4, 0.0);
    }

    /// Sums each token's group sums into runs of 16.
    pub fn sum_runs_of_16(&mut self, t: usize) {
        let per_token = self.n_chunks * 4;
        for i in 0..per_token {
            let g = t * self.n_chunks * GROUPS_PER_CHUNK + 4 * i;
            self.s16[t * per_token + i] = self.s[g] + self.s[g + 1] + self.s[g + 2] + self.s[g + 3];
        }
    }

    /// Block scale and `d * sum(q)` of the `block_len` (16 or 32) values of token `t` from `elem`.
    #[inline(always)]
    pub fn block_scales(&self, t: usize, elem: usize, block_len: usize) -> (f32, f32) {
        let d = self.d[(t * self.n_chunks * CHUNK + elem) / GROUP];
        let runs = &self.s16[(t * self.n_chunks * CHUNK + elem) / 16..];
        let s = if block_len == 32 { runs[0] + runs[1] } else { runs[0] };
        (d, s)
    }

    pub fn row_q(&self, t: usize) -> &[i8] {
        &self.q[t * self.n_chunks * CHUNK..(t + 1) * self.n_chunks * CHUNK]
    }
    pub fn row_d(&self, t: usize) -> &[f32] {
        &self.d[t * self.n_chunks * GROUPS_PER_CHUNK..(t + 1) * self.n_chunks * GROUPS_PER_CHUNK]
    }
    pub fn row_s(&self, t: usize) -> &[f32] {
        &self.s[t * self.n_chunks * GROUPS_PER_CHUNK..(t + 1) * self.n_chunks * GROUPS_PER_CHUNK]
    }
}

/// Quantizes one row `x` into 32-value blocks (`q = round(x / d)`, `d = max|x| / 127`), writing
/// the padded quants, per-group scales and per-group scaled sums.
#[inline(always)]
pub fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    q.fill(0);
    d.fill(0.0);
    s.fill(0.0);
    for (b, block) in x.chunks(32).enumerate() {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let qb = &mut q[b * 32..b * 32 + block.len()];
        for (qv, &xv) in qb.iter_mut().zip(block) {
            *qv = (xv * inv).round_ties_even() as i8;
        }
        for g in 0..block.len().div_ceil(GROUP) {
            let gi = b * 32 / GROUP + g;
            let sum: i32 = qb[g * GROUP..((g + 1) * GROUP).min(qb.len())]
                .iter()
                .map(|&v| v as i32)
                .sum();
            d[gi] = scale;
            s[gi] = scale * sum as f32;
        }
    }
}

/// Staged weights of a few rows: per row, `n_chunks` chunks of `u`, `a`, `b`.
#[derive(Default)]
pub struct Stage {
    pub n_chunks: usize,
    pub u: Vec<u8>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

impl Stage {
    pub fn resize(&mut self, rows: usize, n_chunks: usize) {
        self.n_chunks = n_chunks;
        self.u.resize(rows * n_chunks * CHUNK, 0);
        self.a.resize(rows * n_chunks * GROUPS_PER_CHUNK, 0.0);
        self.b.resize(rows * n_chunks * GROUPS_PER_CHUNK, 0.0);
    }
}

/// A raw output pointer shared by the threads of one matmul; each writes disjoint elements.
#[derive(Clone, Copy)]
pub struct OutPtr(pub *mut f32);
// SAFETY: threads write disjoint indices (their own rows) and the caller waits for all of them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper rather than the field).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}
