//! Quantizers: f32 rows to Q8_0, Q4_0, Q5_0 and Q4_K blocks, for `axiom convert`. Each produces
//! blocks the reference dequantizers in `quant.rs` read back; the tests bound the round-trip error.

use super::quant::{GgmlType, QK_K};
use crate::{Error, Result};
use half::f16;

/// Quantizes `x` (a whole number of blocks) to `ty`, appending the blocks to `out`.
pub fn quantize(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => x.chunks_exact(32).for_each(|b| q8_0(b, out)),
        GgmlType::Q4_0 => x.chunks_exact(32).for_each(|b| q4_0(b, out)),
        GgmlType::Q5_0 => x.chunks_exact(32).for_each(|b| q5_0(b, out)),
        GgmlType::Q4K => x.chunks_exact(QK_K).for_each(|b| q4_k(b, out)),
        other => return Err(Error::InvalidArgument(format!("no quantizer for {other}"))),
    }
    Ok(())
}

/// Types `quantize` writes.
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q4K
    )
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend(x.iter().map(|v| (v * inv).round() as i8 as u8));
}

/// Q4_0 as ggml makes it: the value of largest magnitude maps to -8, so d may be negative.
fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let max = x
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * inv + 8.5) as i32).clamp(0, 15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

/// Q5_0 as ggml makes it: Q4_0 with a fifth bit, the value of largest magnitude mapping to -16.
fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let max = x
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = max / -16.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q: [u32; 32] = std::array::from_fn(|j| ((x[j] * inv + 16.5) as i32).clamp(0, 31) as u32);
    let high = q.iter().enumerate().fold(0u32, |h, (j, v)| h | (v >> 4) << j);
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&high.to_le_bytes());
    out.extend((0..16).map(|j| (q[j] & 15) as u8 | ((q[j + 16] & 15) as u8) << 4));
}

/// Q4_K: per 32-value sub-block a scale and a minimum (min <= 0 shifts), quantized to 6 bits
/// against the super-block's f16 `d` and `dmin`. Scales come from each sub-block's range (a
/// plain choice; llama.cpp searches for slightly better ones).
fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scales[j] = (hi - lo) / 15.0;
        mins[j] = -lo;
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let quant6 = |v: f32, step: f32| {
        if step > 0.0 {
            ((v / step).round() as i32).clamp(0, 63) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = scales.iter().map(|&s| quant6(s, df)).collect();
    let m: Vec<u8> = mins.iter().map(|&v| quant6(v, dminf)).collect();
    // Pack as get_scale_min_k4 reads: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales)
    // and 4-7 (mins); 4-7 split into nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7.
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&packed);
    let mut q = [0u8; QK_K];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let (step, shift) = (df * sc[j] as f32, dminf * m[j] as f32);
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        for (l, &v) in sub.iter().enumerate() {
            q[j * 32 + l] = (((v + shift) * inv).round() as i32).clamp(0, 15) as u8;
        }
    }
    for chunk in 0..4 {
        for l in 0..32 {
            out.push(q[chunk * 64 + l] | (q[chunk * 64 + 32 + l] << 4));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::quant::dequantize;

    fn roundtrip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let mut bytes = Vec::new();
        quantize(ty, x, &mut bytes).unwrap();
        assert_eq!(bytes.len(), ty.bytes_for(x.len()).unwrap());
        let mut y = vec![0f32; x.len()];
        dequantize(ty, &bytes, &mut y);
        y
    }

    #[test]
    fn round_trips_stay_within_the_quantization_step() {
        let x: Vec<f32> = (0..1024)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 5) as f32))
            .collect();
        for (ty, tol) in [
            (GgmlType::Q8_0, 1.0 / 127.0),
            (GgmlType::Q4_0, 1.0 / 8.0),
            (GgmlType::Q5_0, 1.0 / 16.0),
            (GgmlType::Q4K, 1.0 / 10.0),
        ] {
            let y = roundtrip(ty, &x);
            let block = ty.block_len().min(32);
            for (bx, by) in x.chunks(block).zip(y.chunks(block)) {
                let range = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= tol * range + 1e-6, "{ty}: {a} -> {b} (range {range})");
                }
            }
        }
        assert_eq!(roundtrip(GgmlType::F32, &x), x);
    }
}
