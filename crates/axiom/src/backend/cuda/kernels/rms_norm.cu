// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; one block per row, of up to 1024 threads (the host
// sizes it to the row). With ADD, x[t] += y[t] first (the residual add fused into the norm that
// follows it). The pointers are restrict so that a thread's loads of the row go out together: a
// row is a few dependent memory round trips, not one per value.
template <bool ADD>
__device__ void rms_norm_row(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                             float* __restrict__ out, int dim, float eps) {
    __shared__ float partial[32];
    begin_after_inputs();
    float* row = x + (u64)blockIdx.x * dim;
    float sum = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = row[i];
        if (ADD) {
            v += y[(u64)blockIdx.x * dim + i];
            row[i] = v;
        }
        sum += v * v;
    }
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < (blockDim.x + 31) / 32; i++) total += partial[i];
    float scale = rsqrtf(total / dim + eps);
    // Each thread reads back only the values it wrote.
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(u64)blockIdx.x * dim + i] = row[i] * scale * w[i];
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    rms_norm_row<false>((float*)x, nullptr, w, out, dim, eps);
}

extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, int dim, float eps) {
    rms_norm_row<true>(x, y, w, out, dim, eps);
}
