// RoPE on Q and K and the KV-cache write in one dispatch, for the start of a layer's attention.
// One threadgroup per (token, head of Q then K): it rotates a query head, or rotates a key head
// and then stores it and its value head in the token's cache row (page_row in common.metal).
template <typename T>
void rope_kv_write_head(device float* q, device float* k, device const float* v, device T* k_cache,
                        device T* v_cache, device const uint* positions, device const float* freqs,
                        device const uint* tables, uint table_width, device const uint* token_seqs, uint page_size,
                        uint n_heads, uint n_kv_heads, uint head_dim, uint dims, uint halves, float scale, uint t,
                        uint h, uint tid, uint threads) {
    if (h < n_heads) {
        rotate_head(q + (ulong(t) * n_heads + h) * head_dim, positions[t], freqs, dims, halves, scale, tid, threads);
        return;
    }
    uint kh = h - n_heads;
    ulong src = (ulong(t) * n_kv_heads + kh) * head_dim;
    rotate_head(k + src, positions[t], freqs, dims, halves, scale, tid, threads);
    threadgroup_barrier(mem_flags::mem_device);  // the rotated head is complete before it is stored
    device const uint* table = tables + ulong(token_seqs[t]) * table_width;
    ulong dst = page_row(table, page_size, positions[t]) * n_kv_heads * head_dim + ulong(kh) * head_dim;
    for (uint i = tid; i < head_dim; i += threads) {
        k_cache[dst + i] = T(k[src + i]);
        v_cache[dst + i] = T(v[src + i]);
    }
}

#define ROPE_KV_WRITE(NAME, T)                                                                                     \
    kernel void rope_kv_write_##NAME(device float* q [[buffer(0)]], device float* k [[buffer(1)]],                 \
                                     device const float* v [[buffer(2)]], device T* k_cache [[buffer(3)]],         \
                                     device T* v_cache [[buffer(4)]], device const uint* positions [[buffer(5)]],  \
                                     device const float* freqs [[buffer(6)]], device const uint* tables [[buffer(7)]], \
                                     constant uint& table_width [[buffer(8)]],                                     \
                                     device const uint* token_seqs [[buffer(9)]], constant uint& page_size [[buffer(10)]], \
                                     constant uint& n_heads [[buffer(11)]], constant uint& n_kv_heads [[buffer(12)]], \
                                     constant uint& head_dim [[buffer(13)]], constant uint& dims [[buffer(14)]],   \
                                     constant uint& halves [[buffer(15)]], constant float& scale [[buffer(16)]],   \
                                     uint2 group [[threadgroup_position_in_grid]],                                 \
                                     uint tid [[thread_index_in_threadgroup]],                                     \
                                     uint2 group_size [[threads_per_threadgroup]]) {                               \
        rope_kv_write_head<T>(q, k, v, k_cache, v_cache, positions, freqs, tables, table_width, token_seqs,        \
                              page_size, n_heads, n_kv_heads, head_dim, dims, halves, scale, group.x, group.y, tid, \
                              group_size.x);                                                                       \
    }

ROPE_KV_WRITE(f16, half)
ROPE_KV_WRITE(f32, float)
