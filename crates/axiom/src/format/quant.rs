//! Tensor element types of GGML/GGUF and their block layouts, each with a plain reference
//! dequantizer. These are the ground truth every fast kernel is tested against, so they are
//! written for clarity, one block at a time, following the layouts of ggml's `ggml-common.h`.

use super::fp8;
use half::{bf16, f16};
use std::fmt;

/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// A tensor element type, numbered as in GGUF (`ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// FP8 E4M3 codes of a Hugging Face FP8 checkpoint, not a GGUF type: blocks of an f32 scale
    /// and 32 codes of a row (format/fp8.rs), whatever the checkpoint's scales cover.
    Fp8,
}

impl GgmlType {
    /// The GGUF types.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type for a GGUF type id, or `None` for ids this engine does not support.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            // No GGUF type: an id no GGUF file uses, so that no reader takes it for one.
            GgmlType::Fp8 => u32::MAX,
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
            GgmlType::Fp8 => fp8::CODES_PER_BLOCK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q2K => 16 + 64 + 2 + 2,
            GgmlType::Q3K => 32 + 64 + 12 + 2,
            GgmlType::Q4K => 2 + 2 + 12 + 128,
            GgmlType::Q5K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6K => 128 + 64 + 16 + 2,
            GgmlType::Fp8 => fp8::BLOCK_BYTES,
        }
    }

    /// Bytes taken by `n` elements, or `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// Bytes of a row of `n` values, for a length already checked with [`bytes_for`](Self::bytes_for)
    /// (weights are checked when they are loaded, so kernels need not check again).
    pub fn row_bytes(self, n: usize) -> usize {
        debug_assert!(
            n.is_multiple_of(self.block_len()),
            "{n} values are not whole {self} blocks"
        );
        n / self.block_len() * self.block_bytes()
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Fp8 => "FP8_E4M3",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Name of a GGUF type id, including the ones this engine cannot run, for error messages.
pub fn type_id_name(id: u32) -> String {
    match GgmlType::from_id(id) {
        Some(t) => t.name().to_string(),
        None => {
            let known = match id {
                4 => "Q4_2 (removed)",
                5 => "Q4_3 (removed)",
                9 => "Q8_1",
                15 => "Q8_K",
                16 => "IQ2_XXS",
                17 => "IQ2_XS",
                18 => "IQ3_XXS",
                19 => "IQ1_S",
                20 => "IQ4_NL",
                21 => "IQ3_S",
                22 => "IQ2_S",
                23 => "IQ4_XS",
                24 => "I8",
                25 => "I16",
                26 => "I32",
                27 => "I64",
                28 => "F64",
                29 => "IQ1_M",
                34 => "TQ1_0",
                35 => "TQ2_0",
                39 => "MXFP4",
                _ => "unknown",
            };
            format!("{known} (type id {id})")
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `out.len()` elements (a whole number of blocks) from `src` into `out`.
///
/// Panics if `src` is shorter than the blocks `out` needs: callers size both from validated shapes.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let bl = ty.block_len();
    let bb = ty.block_bytes();
    assert_eq!(
        out.len() % bl,
        0,
        "{ty}: {} elements is not a whole number of blocks",
        out.len()
    );
    for (block, dst) in src.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
        dequantize_block(ty, block, dst);
    }
}

/// Dequantizes one block of `ty` (`ty.block_bytes()` bytes) into `ty.block_len()` floats.
pub fn dequantize_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0x0f) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = (((qs[j] & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
                y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = ((qs[j] & 0x0f) as u32 | h0) as f32 * d + m;
                y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = b[2 + j] as i8 as f32 * d;
            }
        }
        GgmlType::Q2K => dequantize_q2k(b, y),
        GgmlType::Q3K => dequantize_q3k(b, y),
        GgmlType::Q4K => dequantize_q4k(b, y),
        GgmlType::Q5K => dequantize_q5k(b, y),
        GgmlType::Q6K => dequantize_q6k(b, y),
        GgmlType::Fp8 => {
            let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for (y, &code) in y.iter_mut().zip(&b[4..fp8::BLOCK_BYTES]) {
                *y = fp8::E4M3_VALUES[code as usize] * scale;
            }
        }
    }
}

/// Q2_K: 16 sub-blocks of 16; each has a 4-bit scale and 4-bit min, scaled by `d` and `dmin`.
/// Layout: scales[16], qs[64] (2 bits each), d: f16, dmin: f16.
fn dequantize_q2k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut out = 0;
    let mut is = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                for &qv in &q[part * 16..part * 16 + 16] {
                    y[out] = dl * ((qv >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Q3_K: 16 sub-blocks of 16 with signed 6-bit scales; the third bit of each quant is in hmask.
/// Layout: hmask[32], qs[64], scales[12], d: f16.
fn dequantize_q3k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let packed = &b[96..108];
    let d = f16_at(b, 108);

    // Unpack the 16 six-bit scales: low 4 bits from the first 8 bytes, high 2 bits from the last 4.
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = ((low | (high << 4)) as i8) - 32;
    }

    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                for l in part * 16..part * 16 + 16 {
                    let low = ((q[l] >> shift) & 3) as i32;
                    let high = if hmask[l] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc, m)
    }
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins. Layout: d, dmin: f16, scales[12], qs[128].
fn dequantize_q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        for (nibble, j) in [(0, 2 * chunk), (4, 2 * chunk + 1)] {
            let (sc, m) = scale_min_k4(j, scales);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            for l in 0..32 {
                y[j * 32 + l] = dl * ((q[l] >> nibble) & 0x0f) as f32 - ml;
            }
        }
    }
}

/// Q5_K: as Q4_K plus a fifth bit per quant in qh. Layout: d, dmin, scales[12], qh[32], qs[128].
fn dequantize_q5k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        for (nibble, j) in [(0, 2 * chunk), (4, 2 * chunk + 1)] {
            let (sc, m) = scale_min_k4(j, scales);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            let hbit = 1u8 << j;
            for l in 0..32 {
                let high = if qh[l] & hbit != 0 { 16 } else { 0 };
                y[j * 32 + l] = dl * (((q[l] >> nibble) & 0x0f) + high) as f32 - ml;
            }
        }
    }
}

/// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; quants are 4 low bits (ql) + 2 high (qh).
/// Layout: ql[128], qh[64], scales[16]: i8, d: f16.
fn dequantize_q6k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let sc = &b[192..208];
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[half * 64..], &qh[half * 32..], &sc[half * 8..]);
        let y = &mut y[half * 128..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}
