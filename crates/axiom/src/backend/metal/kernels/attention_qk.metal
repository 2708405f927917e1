// The seed's first attention pass, over the paged KV cache: the score of every (token, head,
// position) of a step, scale * q.k capped to softcap * tanh(s / softcap) where softcap is not 0;
// -inf beyond the token's own position (the causal mask) and before its window (the last
// `window` positions up to its own; 0: no window).
// scores is [n_tokens * n_heads, n_ctx]; one thread per score.
template <typename T>
void attention_qk_score(device const float* q, device const T* k_cache, device const uint* positions,
                        device const uint* tables, uint table_width, device const uint* token_seqs, uint page_size,
                        device float* scores, uint n_tokens, uint n_heads, uint n_kv_heads, uint head_dim, uint n_ctx,
                        float scale, float softcap, uint window, uint p, uint row) {
    if (p >= n_ctx || row >= n_tokens * n_heads) return;
    uint t = row / n_heads, h = row % n_heads;
    float score = -INFINITY;
    uint pos = positions[t];
    if (p <= pos && (window == 0 || pos - p < window)) {
        device const uint* table = tables + ulong(token_seqs[t]) * table_width;
        device const T* k = k_cache + page_row(table, page_size, p) * n_kv_heads * head_dim +
                            (h / (n_heads / n_kv_heads)) * head_dim;
        device const float* qh = q + ulong(row) * head_dim;
        float dot = 0.0f;
        for (uint d = 0; d < head_dim; d++) dot += qh[d] * kv_load(k + d);
        score = dot * scale;
        if (softcap != 0.0f) score = softcap * precise::tanh(score / softcap);
    }
    scores[ulong(row) * n_ctx + p] = score;
}

#define ATTENTION_QK(NAME, T)                                                                                  \
    kernel void attention_qk_##NAME(device const float* q [[buffer(0)]], device const T* k_cache [[buffer(1)]],    \
                                    device const uint* positions [[buffer(2)]], device const uint* tables [[buffer(3)]], \
                                    constant uint& table_width [[buffer(4)]],                                       \
                                    device const uint* token_seqs [[buffer(5)]], constant uint& page_size [[buffer(6)]], \
                                    device float* scores [[buffer(7)]], constant uint& n_tokens [[buffer(8)]],       \
                                    constant uint& n_heads [[buffer(9)]], constant uint& n_kv_heads [[buffer(10)]], \
                                    constant uint& head_dim [[buffer(11)]], constant uint& n_ctx [[buffer(12)]],     \
                                    constant float& scale [[buffer(13)]], constant float& softcap [[buffer(14)]],   \
                                    constant uint& window [[buffer(15)]],                                            \
                                    uint2 tid [[thread_position_in_grid]]) {                                        \
        attention_qk_score<T>(q, k_cache, positions, tables, table_width, token_seqs, page_size, scores, n_tokens,  \
                              n_heads, n_kv_heads, head_dim, n_ctx, scale, softcap, window, tid.x, tid.y);                                   \
    }

ATTENTION_QK(f16, half)
ATTENTION_QK(f32, float)
