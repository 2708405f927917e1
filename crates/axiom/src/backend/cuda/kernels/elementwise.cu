// out = silu(gate) * up
extern "C" __global__ void swiglu(const float* gate, const float* up, float* out, u64 n) {
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y
extern "C" __global__ void add(float* x, const float* y, u64 n) {
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] += y[i];
}

// x[t] += bias for rows of `width`
extern "C" __global__ void add_bias(float* x, const float* bias, u64 n, u64 width) {
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] += bias[i % width];
}

// f32 to f16 or bf16 (to_16bit, common.cuh), for the cuBLAS inputs: four values a thread, with
// 16-byte loads where the buffers allow.

extern "C" __global__ void convert_f32(const float* x, u16* out, u64 n, int kind) {
    begin_after_inputs();
    bool aligned = ((u64)x | (u64)out) % 16 == 0;
    for (u64 i = 4 * (blockIdx.x * (u64)blockDim.x + threadIdx.x); i < n; i += 4 * (u64)gridDim.x * blockDim.x) {
        if (aligned && i + 4 <= n) {
            float4 v = *(const float4*)(x + i);
            uint2 packed = {(u32)to_16bit(v.x, kind) | ((u32)to_16bit(v.y, kind) << 16),
                            (u32)to_16bit(v.z, kind) | ((u32)to_16bit(v.w, kind) << 16)};
            *(uint2*)(out + i) = packed;
        } else {
            for (u64 j = i; j < n && j < i + 4; j++) out[j] = to_16bit(x[j], kind);
        }
    }
}
