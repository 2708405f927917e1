use crate::backend::{Rope, RopeLayout};

/// Rotates each head of each token's row in place: pair i by the angle `pos * freqs[i]`
/// (computed in f64), the pair's cosine and sine scaled by `rope.scale`.
pub fn rope(x: &mut [f32], positions: &[u32], freqs: &[f32], n_heads: usize, head_dim: usize, rope: Rope) {
    let (half, layout, scale) = (freqs.len(), rope.layout, rope.scale as f64);
    let mut table = vec![(0f64, 0f64); half];
    for (row, &pos) in x.chunks_exact_mut(n_heads * head_dim).zip(positions) {
        for (entry, &freq) in table.iter_mut().zip(freqs) {
            let (sin, cos) = (pos as f64 * freq as f64).sin_cos();
            *entry = (sin * scale, cos * scale);
        }
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(sin, cos)) in table.iter().enumerate() {
                let (a, b) = match layout {
                    RopeLayout::Adjacent => (2 * i, 2 * i + 1),
                    RopeLayout::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a] as f64, head[b] as f64);
                head[a] = (x0 * cos - x1 * sin) as f32;
                head[b] = (x0 * sin + x1 * cos) as f32;
            }
        }
    }
}
