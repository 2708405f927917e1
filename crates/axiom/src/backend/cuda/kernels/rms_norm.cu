// RMSNorm, out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w: one block per row.

// The one-token norms lie on decode's critical path, twice a layer, so a block holds its row in
// registers, a float4 a thread at a time, up to NORM_LOADS of them (rows of a multiple of 4 values,
// up to 16384 in 1024 threads: the host sizes the block, norm_block), and the row makes one trip
// from memory. The norm's weight is not written during a step, so it is loaded before the wait,
// while the kernel before is finishing. (Holding a value a thread in slots of 32 lanes, as
// store_q8 takes them, gained less.) With start_next, the next kernel's blocks start once this
// one's have passed the wait (start_dependents). Every lane calls `store(i4, v, valid)` with
// float4 i4 of the normalized row.
#define NORM_LOADS 4
template <int LOADS = NORM_LOADS, typename Store>
__device__ __forceinline__ void held_rms_norm(const float4* __restrict__ row, const float4* __restrict__ w, int dim,
                                              float eps, int start_next, Store store) {
    int n4 = dim / 4;
    float4 wv[LOADS], xv[LOADS];
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k = 0; k < LOADS; k++) {
        int i = k * blockDim.x + threadIdx.x;
        wv[k] = i < n4 ? __ldg(w + i) : zero;
    }
    begin_after_inputs();
    if (start_next) start_dependents();
    float sum = 0.0f;
    for (int k = 0; k < LOADS; k++) {
        int i = k * blockDim.x + threadIdx.x;
        xv[k] = i < n4 ? __ldg(row + i) : zero;
        sum += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z + xv[k].w * xv[k].w;
    }
    float scale = rsqrtf(block_sum(sum) / dim + eps);
    for (int k = 0; k < LOADS && k * blockDim.x < n4; k++) {
        int i = k * blockDim.x + threadIdx.x;
        float4 v = make_float4(xv[k].x * scale * wv[k].x, xv[k].y * scale * wv[k].y, xv[k].z * scale * wv[k].z,
                               xv[k].w * scale * wv[k].w);
        store(i, v, i < n4);
    }
}

__device__ __forceinline__ void norm_f32(const float4* __restrict__ x, const float4* __restrict__ w,
                                         float4* __restrict__ out, int dim, float eps) {
    u64 base = (u64)blockIdx.x * (dim / 4);
    held_rms_norm(x + base, w, dim, eps, 0, [&](int i4, float4 v, bool valid) {
        if (valid) out[base + i4] = v;
    });
}
extern "C" __global__ void rms_norm(RmsNormParams p) { norm_f32(p.x, p.w, p.out, p.dim, p.eps); }

// Two sets of rows of one length normalized in one launch (Qwen3's query heads and key heads):
// blocks from `split` on take the second set.
extern "C" __global__ void rms_norm_pair(RmsNormPairParams p) {
    bool second = blockIdx.x >= p.split;
    u64 base = (u64)(second ? blockIdx.x - p.split : blockIdx.x) * (p.dim / 4);
    float4* out = (second ? p.out[1] : p.out[0]) + base;
    held_rms_norm(p.x[second] + base, p.w[second], p.dim, p.eps, 0, [&](int i4, float4 v, bool valid) {
        if (valid) out[i4] = v;
    });
}

// rms_norm written in 16 bits (f16 or bf16, `kind` as in to_16bit), the input of cuBLAS GEMMs: the
// norm and the conversion in one pass. Only prefill's many rows take it, so a block is as small as
// holds its row (up to NORM_LOADS float4 a thread: the host sizes it, norm_16_block) and many rows
// are in flight.
__device__ __forceinline__ void norm_16(const float4* __restrict__ x, const float4* __restrict__ w,
                                        uint2* __restrict__ out, int dim, float eps, int kind) {
    u64 base = (u64)blockIdx.x * (dim / 4);
    held_rms_norm(x + base, w, dim, eps, 0, [&](int i4, float4 v, bool valid) {
        if (valid) out[base + i4] = pack_16bit4(v, kind);
    });
}
extern "C" __global__ void rms_norm_16(RmsNorm16Params p) { norm_16(p.x, p.w, p.out, p.dim, p.eps, p.kind); }

// rms_norm with the normalized row quantized as quantize_q8 does (store_q8x4), for an integer
// matrix-vector product: the norm of its input and the quantization in one pass. dim is a
// multiple of 32 (of 256 with `interleave`, for Q4_K: q8_slot). With start_next, the product's
// blocks start meanwhile.
// With `rows`, the normalized rows are also written there in f32 (a mixture block's router reads
// them, its experts the quantized ones).
template <int LOADS>
__device__ __forceinline__ void norm_q8(const float4* __restrict__ x, const float4* __restrict__ w, u32* __restrict__ xq,
                                        float* __restrict__ xd, float4* __restrict__ rows, int dim, float eps,
                                        int interleave, int start_next) {
    u64 base = (u64)blockIdx.x * (dim / 4);
    held_rms_norm<LOADS>(x + base, w, dim, eps, start_next, [&](int i4, float4 v, bool valid) {
        if (rows && valid) rows[base + i4] = v;
        store_q8x4(v, valid, xq, xd, base + i4, base + q8_slot(4 * i4, dim, interleave) / 4, interleave);
    });
}

extern "C" __global__ void rms_norm_q8(RmsNormQ8Params p) {
    norm_q8<NORM_LOADS>(p.x, p.w, p.xq, p.xd, nullptr, p.dim, p.eps, p.interleave, p.start_next);
}

extern "C" __global__ void rms_norm_q8_rows(RmsNormQ8Params p) {
    norm_q8<NORM_LOADS>(p.x, p.w, p.xq, p.xd, p.rows, p.dim, p.eps, p.interleave, p.start_next);
}

// The same at one float4 a thread (rows up to 4096 values), held to 24 registers: a block of 1024
// threads then takes 24,576 of a multiprocessor's 65,536 registers and fits beside the two blocks
// of the product before it (wo or down, EvenSpread: 36,864), so it is placed, and loads its
// weight, while that product streams. (Left to itself NVRTC takes 27, which the hardware
// allocates as 32, and then the block does not fit.)
extern "C" __global__ void __maxnreg__(24) rms_norm_q8_1(RmsNormQ8Params p) {
    norm_q8<1>(p.x, p.w, p.xq, p.xd, nullptr, p.dim, p.eps, p.interleave, p.start_next);
}
