// The activations of a prompt's products with FP8 weights, quantized on the fly for cuBLASLt's
// FP8 GEMM (cuda/fp8_gemm.rs; compiled only for sm_90a, the one architecture whose cuBLASLt takes
// these scale layouts): E4M3 codes, a token's row contiguous, and an f32 scale per 128 values of
// a token (the largest magnitude maps to 448, E4M3's largest finite value), stored token-major
// (scale g of token t at g * cols + t) as cuBLASLt's 128-value scales of its B operand are.
// Tokens from n_tokens to cols (the step padded to a multiple of 4, which cuBLASLt wants) get
// zero codes and scales.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Two floats to two E4M3 codes, rounded to nearest and clamped to the finite range (a NaN stays
// NaN); `lo` in the low byte.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    u16 codes;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(codes) : "f"(hi), "f"(lo));
    return codes;
}

// A warp a (token, 128 values), four values a lane.
extern "C" __global__ void quantize_fp8(QuantizeFp8Params p) {
    const int groups = p.n_in / 128, lane = threadIdx.x % 32;
    const u64 warps = (u64)p.cols * groups;
    begin_after_inputs();
    for (u64 w = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32; w < warps; w += (u64)gridDim.x * blockDim.x / 32) {
        const u64 t = w / groups;
        const int g = (int)(w % groups);
        const u64 at = t * p.n_in + g * 128 + lane * 4;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (t < (u64)p.n_tokens) {
            if (p.kind == TY_F32) {
                float4 x = *((const float4*)p.x + at / 4);
                v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
            } else {
                uint2 x = *((const uint2*)p.x + at / 4);
                const u16* h = (const u16*)&x;
                for (int j = 0; j < 4; j++) v[j] = from_16bit(h[j], p.kind);
            }
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        // An all-zero group keeps zero codes and a zero scale.
        const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
        p.codes[at / 4] = e4m3x2(v[0] * inv, v[1] * inv) | e4m3x2(v[2] * inv, v[3] * inv) << 16;
        if (lane == 0) p.scales[(u64)g * p.cols + t] = amax / 448.0f;
    }
}
#endif
