use super::dot;
use super::paged::PageMap;
use crate::backend::{AttentionShape, Scores};

/// Causal grouped-query attention over a paged KV cache of rows `n_kv_heads * head_dim` wide.
///
/// Token `t` attends to the positions up to `positions[t]` of its sequence that `scores` lets it
/// see; query head `h` reads KV head `h / (n_heads / n_kv_heads)`. Scores are scaled (and capped)
/// as `scores` says and softmaxed in f32.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    positions: &[u32],
    pages: &PageMap,
    out: &mut [f32],
    shape: AttentionShape,
    rule: Scores,
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let group = n_heads / n_kv_heads;
    let kv_width = shape.kv_width();
    let mut scores = Vec::new();
    for (t, &pos) in positions.iter().enumerate() {
        let visible = rule.first_visible(pos as usize)..pos as usize + 1;
        for h in 0..n_heads {
            let qh = &q[(t * n_heads + h) * head_dim..][..head_dim];
            let kv_off = (h / group) * head_dim;
            scores.clear();
            scores.extend(
                visible
                    .clone()
                    .map(|p| rule.apply(dot(qh, &k_cache[pages.row(t, p) * kv_width + kv_off..][..head_dim]))),
            );
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let oh = &mut out[(t * n_heads + h) * head_dim..][..head_dim];
            oh.fill(0.0);
            for (p, &w) in visible.clone().zip(scores.iter()) {
                let vrow = &v_cache[pages.row(t, p) * kv_width + kv_off..][..head_dim];
                for (o, &v) in oh.iter_mut().zip(vrow) {
                    *o += w / sum * v;
                }
            }
        }
    }
}
