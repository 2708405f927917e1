// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. One threadgroup per row; the sum of squares is
// reduced within each simdgroup, then across them through threadgroup memory.
kernel void rms_norm(device const float* x [[buffer(0)]], device const float* w [[buffer(1)]],
                     device float* out [[buffer(2)]], constant uint& dim [[buffer(3)]],
                     constant float& eps [[buffer(4)]], uint row [[threadgroup_position_in_grid]],
                     uint tid [[thread_position_in_threadgroup]], uint threads [[threads_per_threadgroup]],
                     uint simd [[simdgroup_index_in_threadgroup]], uint simds [[simdgroups_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    device const float* xr = x + ulong(row) * dim;
    float sum = 0.0f;
    for (uint i = tid; i < dim; i += threads) sum += xr[i] * xr[i];
    sum = simd_sum(sum);
    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < simds; s++) total += partial[s];
    float scale = rsqrt(total / float(dim) + eps);
    for (uint i = tid; i < dim; i += threads) out[ulong(row) * dim + i] = xr[i] * scale * w[i];
}
