use crate::format::quant::{dequantize, GgmlType};

/// `out[t] = row ids[t]` of a `[vocab, dim]` table stored in `ty`.
pub fn embed(ty: GgmlType, table: &[u8], dim: usize, ids: &[u32], out: &mut [f32]) {
    let row_bytes = ty.row_bytes(dim);
    for (&id, out_row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        let start = id as usize * row_bytes;
        dequantize(ty, &table[start..start + row_bytes], out_row);
    }
}
