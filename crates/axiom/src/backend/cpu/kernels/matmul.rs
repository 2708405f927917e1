use super::dot;
use crate::format::quant::{dequantize, GgmlType};

/// `out[t, o] = sum_i x[t, i] * w[o, i]` for the rows `o` in `rows` of a weight stored in `ty`.
///
/// `out` holds `[n_tokens, rows.len()]`. Each weight row is dequantized once and used for every
/// token, so a batched prefill reads the weights once.
pub fn matmul_rows(ty: GgmlType, w: &[u8], n_in: usize, rows: std::ops::Range<usize>, x: &[f32], out: &mut [f32]) {
    let row_bytes = ty.row_bytes(n_in);
    let n_rows = rows.len();
    let mut wrow = vec![0f32; n_in];
    for (j, o) in rows.enumerate() {
        dequantize(ty, &w[o * row_bytes..(o + 1) * row_bytes], &mut wrow);
        for (t, xt) in x.chunks_exact(n_in).enumerate() {
            out[t * n_rows + j] = dot(xt, &wrow);
        }
    }
}
