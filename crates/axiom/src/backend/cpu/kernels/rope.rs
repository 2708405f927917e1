use crate::backend::{Rope, RopeLayout};

/// Rotates each head of each token's row in place by angles `pos * theta^(-2i/dims)`.
pub fn rope(x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize, rope: Rope) {
    let half = rope.dims / 2;
    let mut table = vec![(0f64, 0f64); half];
    for (row, &pos) in x.chunks_exact_mut(n_heads * head_dim).zip(positions) {
        for (i, entry) in table.iter_mut().enumerate() {
            let freq = (rope.theta as f64).powf(-2.0 * i as f64 / rope.dims as f64);
            *entry = (pos as f64 * freq).sin_cos();
        }
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(sin, cos)) in table.iter().enumerate() {
                let (a, b) = match rope.layout {
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
