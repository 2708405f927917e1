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

// Four floats, each times `inv`, to four E4M3 codes, the first in the low byte.
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d, float inv) {
    return e4m3x2(a * inv, b * inv) | e4m3x2(c * inv, d * inv) << 16;
}

// Eight values a lane, so a half-warp takes a (token, 128 values) and every load is 16 bytes;
// the warps stride over the pairs of groups.
template <typename Load> __device__ __forceinline__ void quantize_fp8_groups(const QuantizeFp8Params& p, Load load) {
    const int groups = p.n_in / 128, lane = threadIdx.x % 32;
    const u64 units = (u64)p.cols * groups, warps = (u64)gridDim.x * blockDim.x / 32;
    begin_after_inputs();
    for (u64 w = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32; 2 * w < units; w += warps) {
        const u64 unit = 2 * w + lane / 16, t = unit / groups;
        const int g = (int)(unit % groups);
        const u64 at = t * p.n_in + g * 128 + lane % 16 * 8;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (unit < units && t < (u64)p.n_tokens) load(at, v);
        float amax = 0.0f;
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
        for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        // An all-zero group keeps zero codes and a zero scale.
        const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
        if (unit < units) {
            *(uint2*)(p.codes + at / 4) =
                make_uint2(e4m3x4(v[0], v[1], v[2], v[3], inv), e4m3x4(v[4], v[5], v[6], v[7], inv));
            if (lane % 16 == 0) p.scales[(u64)g * p.cols + t] = amax / 448.0f;
        }
    }
}

// Eight 16-bit values (`kind`) from 16 bytes.
__device__ __forceinline__ void widen_16bit(uint4 raw, int kind, float* v) {
    const u16* h = (const u16*)&raw;
    for (int j = 0; j < 8; j++) v[j] = from_16bit(h[j], kind);
}

extern "C" __global__ void quantize_fp8(QuantizeFp8Params p) {
    quantize_fp8_groups(p, [&](u64 at, float* v) {
        if (p.kind == TY_F32) {
            const float4* x = (const float4*)p.x + at / 4;
            float4 a = x[0], b = x[1];
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
            widen_16bit(*((const uint4*)p.x + at / 8), p.kind, v);
        }
    });
}

// The feed-forward block's hidden rows, act(gate) * up of its 16-bit gate and up products (x and
// up), quantized as they are made: no 16-bit rows written and read again.
extern "C" __global__ void quantize_fp8_glu(QuantizeFp8Params p) {
    quantize_fp8_groups(p, [&](u64 at, float* v) {
        float g[8], u[8];
        widen_16bit(*((const uint4*)p.x + at / 8), p.kind, g);
        widen_16bit(*((const uint4*)p.up + at / 8), p.kind, u);
        for (int j = 0; j < 8; j++) v[j] = glu_of(g[j], u[j], p.act);
    });
}

// rms_norm_16 that also writes the row quantized as quantize_fp8 does, for the FP8 product that
// reads it first: a warp's 32 float4 are one 128-value group (the host takes rows of whole groups
// in blocks of whole warps). Blocks from n_tokens to cols write the padding's zero codes.
extern "C" __global__ void rms_norm_16_fp8(RmsNormFp8Params p) {
    const u64 t = blockIdx.x, base = t * (p.dim / 4);
    if (t >= (u64)p.n_tokens) {
        begin_after_inputs();
        for (int i4 = threadIdx.x; i4 < p.dim / 4; i4 += blockDim.x) {
            p.codes[base + i4] = 0;
            if (i4 % 32 == 0) p.scales[(u64)(i4 / 32) * p.cols + t] = 0.0f;
        }
        return;
    }
    const int lane = threadIdx.x % 32;
    held_rms_norm(p.x + base, p.w, p.dim, p.eps, 0, [&](int i4, float4 v, bool valid) {
        float amax = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
        if (!valid) return;
        p.out[base + i4] = pack_16bit4(v, p.kind);
        p.codes[base + i4] = e4m3x4(v.x, v.y, v.z, v.w, inv);
        if (lane == 0) p.scales[(u64)(i4 / 32) * p.cols + t] = amax / 448.0f;
    });
}
#endif
