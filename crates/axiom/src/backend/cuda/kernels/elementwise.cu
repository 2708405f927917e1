// act(g) * u, `act` as `Activation::code`: 0 silu, 1 GELU by its tanh approximation.
__device__ __forceinline__ float glu_of(float g, float u, int act) {
    if (act == 1) return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u;
    return g / (1.0f + expf(-g)) * u;
}

// out = act(gate) * up
extern "C" __global__ void glu(GluParams p) {
    const float *gate = p.gate, *up = p.up;
    float* out = p.out;
    u64 n = p.n;
    int act = p.act;
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = glu_of(gate[i], up[i], act);
}

// glu on 16-bit gate and up products, written in their type (`kind` as in to_16bit): the
// feed-forward block's hidden rows as the down projection's cuBLAS GEMM reads them. Eight values
// a thread, with 16-byte loads (the buffers are arena blocks, 16-byte aligned).
extern "C" __global__ void glu_16(Glu16Params p) {
    const u16 *gate = p.gate, *up = p.up;
    u16* out = p.out;
    u64 n = p.n;
    int kind = p.kind, act = p.act;
    begin_after_inputs();
    for (u64 i = 8 * (blockIdx.x * (u64)blockDim.x + threadIdx.x); i < n; i += 8 * (u64)gridDim.x * blockDim.x) {
        if (i + 8 <= n) {
            uint4 g4 = *(const uint4*)(gate + i), u4 = *(const uint4*)(up + i);
            const u16 *g = (const u16*)&g4, *u = (const u16*)&u4;
            uint4 o4;
            u16* o = (u16*)&o4;
            for (int j = 0; j < 8; j++)
                o[j] = to_16bit(glu_of(from_16bit(g[j], kind), from_16bit(u[j], kind), act), kind);
            *(uint4*)(out + i) = o4;
        } else {
            for (u64 j = i; j < n; j++)
                out[j] = to_16bit(glu_of(from_16bit(gate[j], kind), from_16bit(up[j], kind), act), kind);
        }
    }
}

// x += y
extern "C" __global__ void add(AddParams p) {
    float* x = p.x;
    const float* y = p.y;
    u64 n = p.n;
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] += y[i];
}

// x *= factor
extern "C" __global__ void scale(ScaleParams p) {
    float* x = p.x;
    u64 n = p.n;
    float factor = p.factor;
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] *= factor;
}

// x = cap * tanh(x / cap), `cap` in `factor`
extern "C" __global__ void softcap(ScaleParams p) {
    float* x = p.x;
    u64 n = p.n;
    float cap = p.factor;
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// x[t] += bias for rows of `width`
extern "C" __global__ void add_bias(AddBiasParams p) {
    float* x = p.x;
    const float* bias = p.bias;
    u64 n = p.n, width = p.width;
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] += bias[i % width];
}

// f32 to f16 or bf16 (to_16bit, common.cuh), for the cuBLAS inputs: four values a thread, with
// 16-byte loads where the buffers allow.

extern "C" __global__ void convert_f32(ConvertF32Params p) {
    const float* x = p.x;
    u16* out = p.out;
    u64 n = p.n;
    int kind = p.kind;
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
