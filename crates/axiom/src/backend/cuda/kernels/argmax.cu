// The index of the largest of n values (the lowest index on ties) of each row, for greedy
// decoding on the device. One block of 1024 threads per row.
#define ARGMAX_UNROLL 16

extern "C" __global__ void argmax(const float* rows, int n, u32* outs) {
    begin_after_inputs();
    const float* x = rows + (u64)blockIdx.x * n;
    u32* out = outs + blockIdx.x;
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    float v = __int_as_float(0xff800000u);
    int idx = 0x7fffffff;
    // A thread loads ARGMAX_UNROLL values before comparing any: one at a time, each compare would
    // wait out a memory round trip (48 of them in a row for SmolLM2's vocabulary).
    for (int base = threadIdx.x; base < n; base += ARGMAX_UNROLL * blockDim.x) {
        float vals[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            int i = base + u * blockDim.x;
            vals[u] = i < n ? x[i] : __int_as_float(0xff800000u);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++)
            if (vals[u] > v) { v = vals[u]; idx = base + u * blockDim.x; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (threadIdx.x % 32 == 0) { best_v[threadIdx.x / 32] = v; best_i[threadIdx.x / 32] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; w++)
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) { v = best_v[w]; idx = best_i[w]; }
        *out = (u32)idx;
    }
}
