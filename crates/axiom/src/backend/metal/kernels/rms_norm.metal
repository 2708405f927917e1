// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. One threadgroup per row; the sum of squares is
// reduced within each simdgroup, then across them through threadgroup memory. add_rms_norm adds
// y[t] into x[t] first (the residual add fused into the norm that follows it).
inline void rms_norm_row(device float* x, device const float* y, device const float* w, device float* out, uint dim,
                         float eps, uint row, uint tid, uint threads, uint simd, uint simds, uint lane,
                         threadgroup float* partial) {
    device float* xr = x + ulong(row) * dim;
    float sum = 0.0f;
    for (uint i = tid; i < dim; i += threads) {
        float v = xr[i];
        if (y) {
            v += y[ulong(row) * dim + i];
            xr[i] = v;  // read back below by this same thread only
        }
        sum += v * v;
    }
    sum = simd_sum(sum);
    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < simds; s++) total += partial[s];
    float scale = rsqrt(total / float(dim) + eps);
    for (uint i = tid; i < dim; i += threads) out[ulong(row) * dim + i] = xr[i] * scale * w[i];
}

kernel void rms_norm(device const float* x [[buffer(0)]], device const float* w [[buffer(1)]],
                     device float* out [[buffer(2)]], constant uint& dim [[buffer(3)]],
                     constant float& eps [[buffer(4)]], uint row [[threadgroup_position_in_grid]],
                     uint tid [[thread_position_in_threadgroup]], uint threads [[threads_per_threadgroup]],
                     uint simd [[simdgroup_index_in_threadgroup]], uint simds [[simdgroups_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    // x is only read when nothing is added to it.
    rms_norm_row((device float*)x, nullptr, w, out, dim, eps, row, tid, threads, simd, simds, lane, partial);
}

kernel void add_rms_norm(device float* x [[buffer(0)]], device const float* y [[buffer(1)]],
                         device const float* w [[buffer(2)]], device float* out [[buffer(3)]],
                         constant uint& dim [[buffer(4)]], constant float& eps [[buffer(5)]],
                         uint row [[threadgroup_position_in_grid]], uint tid [[thread_position_in_threadgroup]],
                         uint threads [[threads_per_threadgroup]], uint simd [[simdgroup_index_in_threadgroup]],
                         uint simds [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    rms_norm_row(x, y, w, out, dim, eps, row, tid, threads, simd, simds, lane, partial);
}
