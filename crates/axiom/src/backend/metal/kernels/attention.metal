// Causal grouped-query attention over the paged KV cache, fused into one pass with an online
// softmax. Token t sees positions lo..=positions[t]: the last `window` of them, or all from 0
// where window is 0; its scores are scale * q.k, capped to softcap * tanh(s / softcap) where
// softcap is not 0. One threadgroup per (token, head) of up to ATTN_MAX_SIMDS simdgroups:
// simdgroup s takes positions lo + s, lo + s + simds, ...; each lane holds head dimensions lane,
// lane + lanes, ...; the simdgroups' partial results are merged through threadgroup memory.
// Query head h reads KV head h / (n_heads / n_kv_heads).
#define ATTN_MAX_SIMDS 8
#define ATTN_MAX_PER_LANE 8  // head_dim up to 8 * 32

template <typename T>
void attention_head(device const float* q, device const T* k_cache, device const T* v_cache,
                    device const uint* positions, device const uint* tables, uint table_width,
                    device const uint* token_seqs, uint page_size, device float* out, uint n_heads,
                    uint n_kv_heads, uint head_dim, float scale, float softcap, uint window, uint t, uint h, uint tid, uint threads, uint simd, uint simds,
                    uint lane, uint lanes, threadgroup float* simd_max_score, threadgroup float* simd_sum_exp,
                    threadgroup float* simd_acc) {
    uint kv_width = n_kv_heads * head_dim;
    uint kv_off = (h / (n_heads / n_kv_heads)) * head_dim;
    device const float* qh = q + (ulong(t) * n_heads + h) * head_dim;
    float qv[ATTN_MAX_PER_LANE], acc[ATTN_MAX_PER_LANE];
    for (uint k = 0; k < ATTN_MAX_PER_LANE; k++) {
        uint d = lane + lanes * k;
        qv[k] = d < head_dim ? qh[d] * scale : 0.0f;
        acc[k] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    uint n_ctx = positions[t] + 1, lo = window > 0 && n_ctx > window ? n_ctx - window : 0;
    device const uint* table = tables + ulong(token_seqs[t]) * table_width;
    for (uint p = lo + simd; p < n_ctx; p += simds) {
        ulong row = page_row(table, page_size, p) * kv_width + kv_off;
        float s = 0.0f;
        for (uint k = 0; k < ATTN_MAX_PER_LANE; k++) {
            uint d = lane + lanes * k;
            if (d < head_dim) s += qv[k] * kv_load(k_cache + row + d);
        }
        s = simd_sum(s);
        if (softcap != 0.0f) s = softcap * precise::tanh(s / softcap);
        float m_new = max(m, s);
        float correction = exp(m - m_new), e = exp(s - m_new);
        l = l * correction + e;
        for (uint k = 0; k < ATTN_MAX_PER_LANE; k++) {
            uint d = lane + lanes * k;
            acc[k] = acc[k] * correction + (d < head_dim ? e * kv_load(v_cache + row + d) : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) {
        simd_max_score[simd] = m;
        simd_sum_exp[simd] = l;
    }
    for (uint k = 0; k < ATTN_MAX_PER_LANE; k++) {
        uint d = lane + lanes * k;
        if (d < head_dim) simd_acc[simd * head_dim + d] = acc[k];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Rescale each simdgroup's part to the common maximum; one that saw no position has l = 0.
    float gm = simd_max_score[0];
    for (uint s = 1; s < simds; s++) gm = max(gm, simd_max_score[s]);
    float total = 0.0f;
    for (uint s = 0; s < simds; s++) total += simd_sum_exp[s] == 0.0f ? 0.0f : simd_sum_exp[s] * exp(simd_max_score[s] - gm);
    device float* oh = out + (ulong(t) * n_heads + h) * head_dim;
    for (uint d = tid; d < head_dim; d += threads) {
        float o = 0.0f;
        for (uint s = 0; s < simds; s++)
            if (simd_sum_exp[s] != 0.0f) o += simd_acc[s * head_dim + d] * exp(simd_max_score[s] - gm);
        oh[d] = o / total;
    }
}

#define ATTENTION(NAME, T)                                                                                    \
    kernel void attention_##NAME(device const float* q [[buffer(0)]], device const T* k_cache [[buffer(1)]],      \
                                 device const T* v_cache [[buffer(2)]], device const uint* positions [[buffer(3)]], \
                                 device const uint* tables [[buffer(4)]], constant uint& table_width [[buffer(5)]], \
                                 device const uint* token_seqs [[buffer(6)]], constant uint& page_size [[buffer(7)]], \
                                 device float* out [[buffer(8)]], constant uint& n_heads [[buffer(9)]],            \
                                 constant uint& n_kv_heads [[buffer(10)]], constant uint& head_dim [[buffer(11)]], \
                                 constant float& scale [[buffer(12)]], constant float& softcap [[buffer(13)]],     \
                                 constant uint& window [[buffer(14)]],                                             \
                                 uint2 group [[threadgroup_position_in_grid]],                                     \
                                 uint tid [[thread_index_in_threadgroup]],                                         \
                                 uint2 group_size [[threads_per_threadgroup]],                                     \
                                 uint simd [[simdgroup_index_in_threadgroup]],                                     \
                                 uint simds [[simdgroups_per_threadgroup]],                                        \
                                 uint lane [[thread_index_in_simdgroup]],                                          \
                                 uint lanes [[threads_per_simdgroup]]) {                                           \
        threadgroup float simd_max_score[ATTN_MAX_SIMDS];                                                         \
        threadgroup float simd_sum_exp[ATTN_MAX_SIMDS];                                                           \
        threadgroup float simd_acc[ATTN_MAX_SIMDS * ATTN_MAX_PER_LANE * 32];                                      \
        attention_head<T>(q, k_cache, v_cache, positions, tables, table_width, token_seqs, page_size, out, n_heads,   \
                          n_kv_heads, head_dim, scale, softcap, window, group.x, group.y, tid, group_size.x, simd, simds, lane, lanes,      \
                          simd_max_score, simd_sum_exp, simd_acc);                                                  \
    }

ATTENTION(f16, half)
ATTENTION(f32, float)
