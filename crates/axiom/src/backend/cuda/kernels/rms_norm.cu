// RMSNorm, out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w: one block per row, of up to 1024 threads
// in whole warps (the host sizes it to the row).

// 1 / sqrt(mean(row^2) + eps), reduced over the whole block. The row pointer is restrict so that a
// thread's loads go out together: a row is a few dependent memory round trips, not one per value.
// Meanwhile the norm's weight `w` is sent into L2: in decode the weights' stream has evicted it,
// and the pass that applies it would wait on memory once more.
__device__ float inverse_rms(const float* __restrict__ row, const float* w, int dim, float eps) {
    float sum = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w + i));
        sum += row[i] * row[i];
    }
    return rsqrtf(block_sum(sum) / dim + eps);
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                    int dim, float eps) {
    begin_after_inputs();
    u64 base = (u64)blockIdx.x * dim;
    float scale = inverse_rms(x + base, w, dim, eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[base + i] = x[base + i] * scale * w[i];
}

// rms_norm written in 16 bits (f16 or bf16, `kind` as in to_16bit), the input of cuBLAS GEMMs: the
// norm and the conversion in one pass. Only prefill's many rows take it, so a block is small (up
// to 256 threads, a float4 each in turn; dim is a multiple of 4) and many rows are in flight:
// 2048 rows of 4096 took 16 us on the H200 (ncu), against 35 with blocks of a thread a value.
extern "C" __global__ void rms_norm_16(const float4* __restrict__ x, const float4* __restrict__ w,
                                       uint2* __restrict__ out, int dim, float eps, int kind) {
    begin_after_inputs();
    int n4 = dim / 4;
    const float4* row = x + (u64)blockIdx.x * n4;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        float4 v = row[i];
        sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    float scale = rsqrtf(block_sum(sum) / dim + eps);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        float4 v = row[i], g = w[i];
        out[(u64)blockIdx.x * n4 + i] =
            make_uint2((u32)to_16bit(v.x * scale * g.x, kind) | ((u32)to_16bit(v.y * scale * g.y, kind) << 16),
                       (u32)to_16bit(v.z * scale * g.z, kind) | ((u32)to_16bit(v.w * scale * g.w, kind) << 16));
    }
}

// rms_norm with the normalized row quantized as quantize_q8 does, for an integer matrix-vector
// product: the norm of its input and the quantization in one pass. It lies on decode's critical
// path twice a layer, so a thread holds its values (a float4 at a time, up to NORM_Q8_LOADS of
// them: rows of up to 16384 values in 1024 threads), and the row makes one trip from memory. The
// norm's weight is not written during a step, so it is loaded before the wait, while the kernel
// before is finishing. 8B decode on the H200, same call: Q8_0 373 -> 390 tok/s, Q4_K 466 -> 486,
// against the row read a second time after the reduction, with the weight only sent into L2
// before the wait. (Held a value a thread, as store_q8 takes them: Q8_0 378, Q4_K no gain.) dim is
// a multiple of 32. With start_next, the product's blocks start meanwhile (start_dependents).
#define NORM_Q8_LOADS 4
extern "C" __global__ void rms_norm_q8(const float4* __restrict__ x, const float4* __restrict__ w, u32* __restrict__ xq,
                                       float* __restrict__ xd, int dim, float eps, int start_next) {
    int n4 = dim / 4;
    float4 wv[NORM_Q8_LOADS], xv[NORM_Q8_LOADS];
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k = 0; k < NORM_Q8_LOADS; k++) {
        int i = k * blockDim.x + threadIdx.x;
        wv[k] = i < n4 ? w[i] : zero;
    }
    begin_after_inputs();
    if (start_next) start_dependents();
    u64 base = (u64)blockIdx.x * n4;
    float sum = 0.0f;
    for (int k = 0; k < NORM_Q8_LOADS; k++) {
        int i = k * blockDim.x + threadIdx.x;
        xv[k] = i < n4 ? x[base + i] : zero;
        sum += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z + xv[k].w * xv[k].w;
    }
    float scale = rsqrtf(block_sum(sum) / dim + eps);
    for (int k = 0; k < NORM_Q8_LOADS && k * blockDim.x < n4; k++) {
        int i = k * blockDim.x + threadIdx.x;
        float4 v = make_float4(xv[k].x * scale * wv[k].x, xv[k].y * scale * wv[k].y, xv[k].z * scale * wv[k].z,
                               xv[k].w * scale * wv[k].w);
        store_q8x4(v, i < n4, xq, xd, base + i);
    }
}
