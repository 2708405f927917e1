// The index of the largest of `width` values of each row (the lowest index on ties), for greedy
// decoding without bringing the logits back. One threadgroup per row. Where `constrained`,
// values whose bit in `allowed` is clear (one word per 32 values of a row) count as -inf.
kernel void argmax(device const float* x [[buffer(0)]], device uint* out [[buffer(1)]],
                   constant uint& width [[buffer(2)]], device const uint* allowed [[buffer(3)]],
                   constant uint& constrained [[buffer(4)]], uint row [[threadgroup_position_in_grid]],
                   uint tid [[thread_position_in_threadgroup]], uint threads [[threads_per_threadgroup]],
                   uint simd [[simdgroup_index_in_threadgroup]], uint simds [[simdgroups_per_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float best_value[32];
    threadgroup uint best_index[32];
    device const float* xr = x + ulong(row) * width;
    device const uint* bits = allowed + ulong(row) * ((width + 31) / 32);
    float v = -INFINITY;
    uint idx = 0xffffffffu;
    for (uint i = tid; i < width; i += threads) {
        float xi = constrained == 0 || (bits[i / 32] >> (i % 32)) & 1u ? xr[i] : -INFINITY;
        if (idx == 0xffffffffu || xi > v) {
            v = xi;
            idx = i;
        }
    }
    float m = simd_max(v);
    idx = simd_min(v == m ? idx : 0xffffffffu);
    if (lane == 0) {
        best_value[simd] = m;
        best_index[simd] = idx;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        for (uint s = 1; s < simds; s++) {
            if (best_value[s] > m || (best_value[s] == m && best_index[s] < idx)) {
                m = best_value[s];
                idx = best_index[s];
            }
        }
        out[row] = idx < width ? idx : 0;  // every value NaN: still a token id
    }
}
