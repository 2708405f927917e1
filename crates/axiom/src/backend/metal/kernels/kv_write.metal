// Stores each token's K and V rows (f32) in its sequence's cache row for positions[t], as f16
// or f32 (see page_row in common.metal). One threadgroup per token.
template <typename T>
void kv_write_rows(device const float* k, device const float* v, device T* k_cache, device T* v_cache,
                   device const uint* positions, device const uint* tables, uint table_width,
                   device const uint* token_seqs, uint page_size, uint kv_width, uint t, uint tid, uint threads) {
    device const uint* table = tables + ulong(token_seqs[t]) * table_width;
    ulong dst = page_row(table, page_size, positions[t]) * kv_width, src = ulong(t) * kv_width;
    for (uint i = tid; i < kv_width; i += threads) {
        k_cache[dst + i] = T(k[src + i]);
        v_cache[dst + i] = T(v[src + i]);
    }
}

#define KV_WRITE(NAME, T)                                                                                   \
    kernel void kv_write_##NAME(device const float* k [[buffer(0)]], device const float* v [[buffer(1)]],       \
                                device T* k_cache [[buffer(2)]], device T* v_cache [[buffer(3)]],               \
                                device const uint* positions [[buffer(4)]], device const uint* tables [[buffer(5)]], \
                                constant uint& table_width [[buffer(6)]], device const uint* token_seqs [[buffer(7)]], \
                                constant uint& page_size [[buffer(8)]], constant uint& kv_width [[buffer(9)]],   \
                                uint t [[threadgroup_position_in_grid]],                                         \
                                uint tid [[thread_position_in_threadgroup]],                                     \
                                uint threads [[threads_per_threadgroup]]) {                                      \
        kv_write_rows<T>(k, v, k_cache, v_cache, positions, tables, table_width, token_seqs, page_size, kv_width, t, \
                         tid, threads);                                                                          \
    }

KV_WRITE(f16, half)
KV_WRITE(f32, float)
