// The seed's second attention pass: softmax over each score row of attention_qk (positions
// 0..=positions[t], those outside the token's window at -inf), then the weighted sum of the value rows. One threadgroup per (token, head)
// of a power-of-two number of threads; the max and the sum are tree reductions in threadgroup
// memory, a barrier after every level.
template <typename T>
void attention_pv_head(device const float* scores, device const T* v_cache, device const uint* positions,
                       device const uint* tables, uint table_width, device const uint* token_seqs, uint page_size,
                       device float* out, uint n_heads, uint n_kv_heads, uint head_dim, uint n_ctx, uint row,
                       uint tid, uint threads, threadgroup float* scratch) {
    uint t = row / n_heads, h = row % n_heads;
    uint n_seen = positions[t] + 1;
    device const float* s = scores + ulong(row) * n_ctx;

    float local_max = -INFINITY;
    for (uint p = tid; p < n_seen; p += threads) local_max = max(local_max, s[p]);
    scratch[tid] = local_max;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = threads / 2; stride > 0; stride /= 2) {
        if (tid < stride) scratch[tid] = max(scratch[tid], scratch[tid + stride]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    float row_max = scratch[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float local_sum = 0.0f;
    for (uint p = tid; p < n_seen; p += threads) local_sum += exp(s[p] - row_max);
    scratch[tid] = local_sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = threads / 2; stride > 0; stride /= 2) {
        if (tid < stride) scratch[tid] += scratch[tid + stride];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    float row_sum = scratch[0];

    device const uint* table = tables + ulong(token_seqs[t]) * table_width;
    uint kv_off = (h / (n_heads / n_kv_heads)) * head_dim;
    for (uint d = tid; d < head_dim; d += threads) {
        float acc = 0.0f;
        for (uint p = 0; p < n_seen; p++) {
            float w = exp(s[p] - row_max) / row_sum;
            acc += w * kv_load(v_cache + page_row(table, page_size, p) * n_kv_heads * head_dim + kv_off + d);
        }
        out[ulong(row) * head_dim + d] = acc;
    }
}

#define ATTENTION_PV(NAME, T)                                                                                    \
    kernel void attention_pv_##NAME(device const float* scores [[buffer(0)]], device const T* v_cache [[buffer(1)]], \
                                    device const uint* positions [[buffer(2)]], device const uint* tables [[buffer(3)]], \
                                    constant uint& table_width [[buffer(4)]],                                         \
                                    device const uint* token_seqs [[buffer(5)]], constant uint& page_size [[buffer(6)]], \
                                    device float* out [[buffer(7)]], constant uint& n_heads [[buffer(8)]],             \
                                    constant uint& n_kv_heads [[buffer(9)]], constant uint& head_dim [[buffer(10)]],  \
                                    constant uint& n_ctx [[buffer(11)]], uint row [[threadgroup_position_in_grid]],   \
                                    uint tid [[thread_position_in_threadgroup]],                                      \
                                    uint threads [[threads_per_threadgroup]]) {                                       \
        threadgroup float scratch[1024];                                                                              \
        attention_pv_head<T>(scores, v_cache, positions, tables, table_width, token_seqs, page_size, out, n_heads,     \
                             n_kv_heads, head_dim, n_ctx, row, tid, threads, scratch);                                \
    }

ATTENTION_PV(f16, half)
ATTENTION_PV(f32, float)
