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

// f32 to f16 (kind 1) or bf16 (kind 30), for the cuBLAS inputs.
extern "C" __global__ void convert_f32(const float* x, u16* out, u64 n, int kind) {
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = kind == TY_BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}
