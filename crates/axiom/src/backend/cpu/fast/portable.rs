//! Portable versions of the fast kernels: plain Rust, correct on any architecture, and the
//! definition the SIMD versions are tested against.

use super::{Q8Activations, Stage, CHUNK, GROUP, GROUPS_PER_CHUNK};
use crate::format::quant::{dequantize, GgmlType, QK_K};
use half::{bf16, f16};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Writes one 32-value block: quants, and the scale/offset of its eight groups.
fn put_block32(u: &mut [u8], a: &mut [f32], b: &mut [f32], quants: impl Iterator<Item = u8>, scale: f32, offset: f32) {
    for (dst, v) in u[..32].iter_mut().zip(quants) {
        *dst = v;
    }
    a[..32 / GROUP].fill(scale);
    b[..32 / GROUP].fill(offset);
}

/// Unpacks row `row` of a `[n_out, n_in]` weight into stage slot `slot`.
pub fn unpack_row(ty: GgmlType, w: &[u8], n_in: usize, row: usize, stage: &mut Stage, slot: usize) {
    let row_bytes = ty.row_bytes(n_in);
    let src = &w[row * row_bytes..(row + 1) * row_bytes];
    let n_chunks = stage.n_chunks;
    let u = &mut stage.u[slot * n_chunks * CHUNK..(slot + 1) * n_chunks * CHUNK];
    let a = &mut stage.a[slot * n_chunks * GROUPS_PER_CHUNK..(slot + 1) * n_chunks * GROUPS_PER_CHUNK];
    let b = &mut stage.b[slot * n_chunks * GROUPS_PER_CHUNK..(slot + 1) * n_chunks * GROUPS_PER_CHUNK];
    // Padding past n_in contributes nothing.
    u[n_in..].fill(0);
    a[n_in / GROUP..].fill(0.0);
    b[n_in / GROUP..].fill(0.0);
    match ty {
        GgmlType::Q8_0 => {
            for (i, blk) in src.chunks_exact(34).enumerate() {
                let d = f16_at(blk, 0);
                let (u, a, b) = (&mut u[i * 32..], &mut a[i * 8..], &mut b[i * 8..]);
                put_block32(u, a, b, blk[2..34].iter().map(|&q| q ^ 0x80), d, -128.0 * d);
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (bytes, qs_at) = if ty == GgmlType::Q4_0 { (18, 2) } else { (20, 4) };
            for (i, blk) in src.chunks_exact(bytes).enumerate() {
                let d = f16_at(blk, 0);
                let offset = if ty == GgmlType::Q4_0 { -8.0 * d } else { f16_at(blk, 2) };
                let qs = &blk[qs_at..qs_at + 16];
                let quants = qs.iter().map(|q| q & 0x0f).chain(qs.iter().map(|q| q >> 4));
                put_block32(&mut u[i * 32..], &mut a[i * 8..], &mut b[i * 8..], quants, d, offset);
            }
        }
        GgmlType::Q5_0 => {
            for (i, blk) in src.chunks_exact(22).enumerate() {
                let d = f16_at(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                let qs = &blk[6..22];
                let low = qs.iter().map(|q| q & 0x0f).chain(qs.iter().map(|q| q >> 4));
                let quants = low.enumerate().map(|(j, q)| q | (((qh >> j) & 1) as u8) << 4);
                put_block32(&mut u[i * 32..], &mut a[i * 8..], &mut b[i * 8..], quants, d, -16.0 * d);
            }
        }
        GgmlType::Q4K => {
            for (i, blk) in src.chunks_exact(144).enumerate() {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                for j in 0..QK_K / 32 {
                    let (sc, m) = scale_min_k4(j, &blk[4..16]);
                    let q = &blk[16 + (j / 2) * 32..16 + (j / 2) * 32 + 32];
                    let shift = 4 * (j % 2);
                    let at = i * QK_K + j * 32;
                    let quants = q.iter().map(|v| (v >> shift) & 0x0f);
                    put_block32(
                        &mut u[at..],
                        &mut a[at / GROUP..],
                        &mut b[at / GROUP..],
                        quants,
                        d * sc as f32,
                        -dmin * m as f32,
                    );
                }
            }
        }
        GgmlType::Q6K => {
            for (i, blk) in src.chunks_exact(210).enumerate() {
                let d = f16_at(blk, 208);
                for half in 0..2 {
                    let (ql, qh) = (&blk[64 * half..], &blk[128 + 32 * half..]);
                    let base = i * QK_K + half * 128;
                    for l in 0..32 {
                        u[base + l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                        u[base + l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                        u[base + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        u[base + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                    for g in 0..128 / GROUP {
                        let scale = d * blk[192 + half * 8 + g * GROUP / 16] as i8 as f32;
                        a[base / GROUP + g] = scale;
                        b[base / GROUP + g] = -32.0 * scale;
                    }
                }
            }
        }
        #[allow(
            clippy::unreachable,
            reason = "callers dispatch here only for types with an integer layout"
        )]
        _ => unreachable!("{ty} has no integer kernel"),
    }
}

pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `out[i] = sum(w * x[t0 + i])` for the staged row in `slot`.
pub fn dot_row(stage: &Stage, slot: usize, x: &Q8Activations, t0: usize, out: &mut [f32]) {
    let n = stage.n_chunks * CHUNK;
    let u = &stage.u[slot * n..(slot + 1) * n];
    let a = &stage.a[slot * n / GROUP..(slot + 1) * n / GROUP];
    let b = &stage.b[slot * n / GROUP..(slot + 1) * n / GROUP];
    for (i, o) in out.iter_mut().enumerate() {
        let t = t0 + i;
        let (q, d, s) = (x.row_q(t), x.row_d(t), x.row_s(t));
        let mut acc = 0f32;
        for g in 0..n / GROUP {
            let dot: i32 = (0..GROUP)
                .map(|k| u[g * GROUP + k] as i32 * q[g * GROUP + k] as i32)
                .sum();
            acc += a[g] * d[g] * dot as f32 + b[g] * s[g];
        }
        *o = acc;
    }
}

/// Converts one row of a float (or FP8) weight to f32.
pub fn float_row(ty: GgmlType, w: &[u8], n_in: usize, row: usize, out: &mut [f32]) {
    let bytes = &w[row * ty.row_bytes(n_in)..(row + 1) * ty.row_bytes(n_in)];
    match ty {
        GgmlType::Fp8 => dequantize(ty, bytes, &mut out[..n_in]),
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        #[allow(clippy::unreachable, reason = "callers dispatch here only for float types")]
        _ => unreachable!("{ty} is not a float type"),
    }
}
