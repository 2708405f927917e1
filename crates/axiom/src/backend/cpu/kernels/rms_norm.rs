/// Each row of `x` divided by its root mean square (plus `eps`), times `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], out: &mut [f32], dim: usize, eps: f32) {
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = row.iter().map(|v| (v * v) as f64).sum::<f64>() / dim as f64;
        let scale = (1.0 / (mean_sq + eps as f64).sqrt()) as f32;
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}
