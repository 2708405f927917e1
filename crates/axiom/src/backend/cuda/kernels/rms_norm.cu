// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; one block of 256 threads per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    __shared__ float partial[8];
    const float* row = x + (u64)blockIdx.x * dim;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < blockDim.x / 32; i++) total += partial[i];
    float scale = rsqrtf(total / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(u64)blockIdx.x * dim + i] = row[i] * scale * w[i];
}
