// Each token's k experts from the router's logits, as cpu/kernels/route.rs chooses them: a
// softmax over the n_experts, the k most probable, the lowest index first among equals, their
// probabilities divided by their sum with `renormalize`. One simdgroup per token. Pick j is the
// best expert ranked after pick j - 1 (probability descending, then index ascending), so nothing
// needs marking as taken.
kernel void route(device const float* logits [[buffer(0)]], device uint* ids [[buffer(1)]],
                  device float* weights [[buffer(2)]], constant uint& n_experts [[buffer(3)]],
                  constant uint& k [[buffer(4)]], constant uint& renormalize [[buffer(5)]],
                  uint token [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                  uint lanes [[threads_per_simdgroup]]) {
    device const float* row = logits + ulong(token) * n_experts;
    float top = -INFINITY;
    for (uint e = lane; e < n_experts; e += lanes) top = max(top, row[e]);
    top = simd_max(top);
    float sum = 0.0f;
    for (uint e = lane; e < n_experts; e += lanes) sum += exp(row[e] - top);
    sum = simd_sum(sum);
    device uint* token_ids = ids + ulong(token) * k;
    device float* token_weights = weights + ulong(token) * k;
    float last_p = INFINITY, chosen = 0.0f;
    uint last_e = 0;
    for (uint j = 0; j < k; j++) {
        // A lane's best in its experts (ascending, so the lowest index among its equals), then
        // the simdgroup's: the highest probability, the lowest index holding it.
        float best_p = -1.0f;
        uint best_e = n_experts;
        for (uint e = lane; e < n_experts; e += lanes) {
            float p = exp(row[e] - top) / sum;
            bool after = p < last_p || (p == last_p && e > last_e);
            if (after && p > best_p) {
                best_p = p;
                best_e = e;
            }
        }
        last_p = simd_max(best_p);
        last_e = simd_min(best_p == last_p ? best_e : n_experts);
        chosen += last_p;
        if (lane == 0) {
            token_ids[j] = last_e;
            token_weights[j] = last_p;
        }
    }
    if (renormalize && lane == 0)
        for (uint j = 0; j < k; j++) token_weights[j] /= chosen;
}
