use crate::backend::Routing;

/// Each row of `logits` (`routing.n_experts` wide) to its `routing.k` experts, most probable
/// first, the lowest index first among equals: a softmax over the row, the k largest
/// probabilities, divided by their sum when `routing.renormalize`. `ids` and `weights` hold
/// `[n_rows, k]`.
pub fn route(logits: &[f32], routing: Routing, ids: &mut [u32], weights: &mut [f32]) {
    let (n, k) = (routing.n_experts, routing.k);
    let mut probs = vec![0f32; n];
    let mut order: Vec<usize> = Vec::with_capacity(n);
    let rows = logits
        .chunks_exact(n)
        .zip(ids.chunks_exact_mut(k).zip(weights.chunks_exact_mut(k)));
    for (row, (ids, weights)) in rows {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
        }
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        order.clear();
        order.extend(0..n);
        // Stable: equal probabilities keep their index order. (torch's topk leaves exact ties to
        // its selection algorithm; the lowest index is a rule every backend can follow.)
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        for (j, &e) in order[..k].iter().enumerate() {
            ids[j] = e as u32;
            weights[j] = probs[e];
        }
        if routing.renormalize {
            let chosen: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= chosen);
        }
    }
}
