// Matrix-vector products for decode, straight from the stored weight type: out[t, o] =
// sum_i x[t, i] * w[o, i] for T tokens at once. One warp per output row; the lanes take the
// row's 32-value chunks in turn (each one 16- or 32-byte aligned load of quants), so a warp
// streams its row once for all T tokens.
__device__ __forceinline__ float dot16(const float* y, const float* x) {
    const float4* xv = (const float4*)x;
    float s = 0.0f;
    for (int k = 0; k < 4; k++) {
        float4 v = __ldg(xv + k);
        s += y[4 * k] * v.x + y[4 * k + 1] * v.y + y[4 * k + 2] * v.z + y[4 * k + 3] * v.w;
    }
    return s;
}

// Up to three matrices of one type multiplied by the same activations in one launch (Q, K and V;
// gate and up): their rows are taken in order, one warp each, eight warps a block.
#define MAX_MATRICES 3
struct Matrices {
    const u8* q[MAX_MATRICES];
    const u8* s[MAX_MATRICES];
    const u8* m[MAX_MATRICES];
    float* out[MAX_MATRICES];
    int n_out[MAX_MATRICES];
    int count;
};

// This warp's matrix and row (ok is false for a warp past the last row). The loop is unrolled so
// that the parameters are indexed by constants: a run-time index would copy them to local memory,
// and the weight's pointers with them.
struct Picked {
    Weight w;
    float* out;
    int n_out;
    int row;
    bool ok;
};

__device__ __forceinline__ Picked pick_row(const Matrices& mats, int n_in) {
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < MAX_MATRICES; i++) {
        if (i < mats.count && r < mats.n_out[i])
            return Picked{Weight{mats.q[i], mats.s[i], mats.m[i], n_in}, mats.out[i], mats.n_out[i], r, true};
        r -= mats.n_out[i];
    }
    return Picked{Weight{nullptr, nullptr, nullptr, n_in}, nullptr, 0, 0, false};
}

template <int TY, int T>
__device__ void gemv(const Matrices& mats, int n_in, const float* x) {
    Picked p = pick_row(mats, n_in);
    if (!p.ok) return;
    const Weight w = p.w;
    float* out = p.out;
    int n_out = p.n_out, row = p.row;
    int lane = threadIdx.x % 32;
    float acc[T];
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    float y[32];
    for (int c = lane; c < w.n_in / 32; c += 32) {
        int at0, at1;
        chunk<TY>(w, row, c, y, &at0, &at1);
        for (int t = 0; t < T; t++) {
            const float* xt = x + (u64)t * w.n_in;
            acc[t] += dot16(y, xt + at0) + dot16(y + 16, xt + at1);
        }
    }
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * n_out + row] = s;
    }
}

// The same products on integers, for large quantized matrices: the activations are first
// quantized per 32 values to int8 with one f32 scale (quantize_q8), then each run of 16 weights is
// dotted with its 16 activations by four dp4a; the run's scale and offset (IntChunk) and the
// activations' scale come in once per run. Far fewer instructions per weight byte than widening
// every value to f32.
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// xq[i] = round(x[i] / d), d = max |x| / 127 over each aligned block of 32 (a warp per block).
extern "C" __global__ void quantize_q8(const float* x, i8* xq, float* xd, u64 n) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    float d = warp_max(fabsf(v)) / 127.0f;
    if (i < n) {
        xq[i] = (i8)(d == 0.0f ? 0 : __float2int_rn(v / d));
        if (i % 32 == 0) xd[i / 32] = d;
    }
}

// Whether a type's runs have offsets (minimums): only then is the activations' sum needed.
template <int TY> struct HasOffset { static const bool value = TY == TY_Q4_1 || TY == TY_Q4_K; };

template <int TY, int T>
__device__ __forceinline__ void dot_chunk(const IntChunk& k, const i8* xq, const float* xd, int n_in, float* acc) {
    for (int t = 0; t < T; t++) {
        u64 xt = (u64)t * n_in;
        for (int r = 0; r < 2; r++) {
            uint4 xv = *(const uint4*)(xq + xt + k.at[r]);
            int dot = dp4a(k.q[4 * r], xv.x, 0);
            dot = dp4a(k.q[4 * r + 1], xv.y, dot);
            dot = dp4a(k.q[4 * r + 2], xv.z, dot);
            dot = dp4a(k.q[4 * r + 3], xv.w, dot);
            float run = k.scale[r] * (float)dot;
            if (HasOffset<TY>::value) {
                int sum = dp4a(0x01010101u, xv.x, dp4a(0x01010101u, xv.y, dp4a(0x01010101u, xv.z, dp4a(0x01010101u, xv.w, 0))));
                run += k.offset[r] * (float)sum;
            }
            acc[t] += xd[(xt + k.at[r]) / 32] * run;
        }
    }
}

template <int TY, int T>
__device__ void gemv_int(const Matrices& mats, int n_in, const i8* xq, const float* xd) {
    Picked p = pick_row(mats, n_in);
    if (!p.ok) return;
    const Weight w = p.w;
    float* out = p.out;
    int n_out = p.n_out, row = p.row;
    int lane = threadIdx.x % 32;
    float acc[T];
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    // (Decoding two or four chunks before using any was measured slower on the H200.)
    for (int c = lane; c < w.n_in / 32; c += 32) dot_chunk<TY, T>(int_chunk<TY>(w, row, c), xq, xd, w.n_in, acc);
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * n_out + row] = s;
    }
}

#define GEMV_INT(NAME, TY, T) \
    extern "C" __global__ void gemv_int_##NAME##_##T(Matrices mats, int n_in, const i8* xq, const float* xd) { \
        gemv_int<TY, T>(mats, n_in, xq, xd); \
    }
#define GEMV_INT_ALL_T(NAME, TY) GEMV_INT(NAME, TY, 1) GEMV_INT(NAME, TY, 2) GEMV_INT(NAME, TY, 4) GEMV_INT(NAME, TY, 8)
GEMV_INT_ALL_T(q8_0, TY_Q8_0)
GEMV_INT_ALL_T(q4_0, TY_Q4_0)
GEMV_INT_ALL_T(q4_1, TY_Q4_1)
GEMV_INT_ALL_T(q4_k, TY_Q4_K)
GEMV_INT_ALL_T(q6_k, TY_Q6_K)

// Float weights: lane-interleaved 16-byte loads, so each warp load is 512 contiguous bytes, with
// UNROLL loads in flight per lane before the first is used; activations read as float4.
template <int TY>
__device__ __forceinline__ void widen(uint4 raw, float* y) {
    u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    if (TY == TY_F32) {
        for (int k = 0; k < 4; k++) y[k] = __uint_as_float(words[k]);
    } else {
        for (int k = 0; k < 4; k++) {
            y[2 * k] = TY == TY_BF16 ? __uint_as_float(words[k] << 16) : f16_to_f32((u16)(words[k] & 0xffff));
            y[2 * k + 1] = TY == TY_BF16 ? __uint_as_float(words[k] & 0xffff0000u) : f16_to_f32((u16)(words[k] >> 16));
        }
    }
}

template <int TY, int T>
__device__ void gemv_float(const Matrices& mats, int n_in, const float* x) {
    Picked p = pick_row(mats, n_in);
    if (!p.ok) return;
    const u8* w = p.w.q;
    float* out = p.out;
    int n_out = p.n_out, row = p.row;
    u64 row_bytes = (u64)n_in * (TY == TY_F32 ? 4 : 2);
    constexpr int PER = TY == TY_F32 ? 4 : 8;  // values per 16-byte load
    constexpr int UNROLL = 4;
    int lane = threadIdx.x % 32;
    const uint4* wrow = (const uint4*)(w + (u64)row * row_bytes);
    int n_loads = n_in / PER;
    float acc[T];
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    int i = lane;
    for (; i + 32 * (UNROLL - 1) < n_loads; i += 32 * UNROLL) {
        uint4 raw[UNROLL];
        for (int u = 0; u < UNROLL; u++) raw[u] = __ldg(wrow + i + 32 * u);
        for (int u = 0; u < UNROLL; u++) {
            float y[8];
            widen<TY>(raw[u], y);
            int at = (i + 32 * u) * PER;
            for (int t = 0; t < T; t++) {
                const float4* xt = (const float4*)(x + (u64)t * n_in + at);
                for (int k = 0; k < PER / 4; k++) {
                    float4 v = __ldg(xt + k);
                    acc[t] += y[4 * k] * v.x + y[4 * k + 1] * v.y + y[4 * k + 2] * v.z + y[4 * k + 3] * v.w;
                }
            }
        }
    }
    for (; i < n_loads; i += 32) {
        float y[8];
        widen<TY>(__ldg(wrow + i), y);
        for (int t = 0; t < T; t++) {
            const float4* xt = (const float4*)(x + (u64)t * n_in + i * PER);
            for (int k = 0; k < PER / 4; k++) {
                float4 v = __ldg(xt + k);
                acc[t] += y[4 * k] * v.x + y[4 * k + 1] * v.y + y[4 * k + 2] * v.z + y[4 * k + 3] * v.w;
            }
        }
    }
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * n_out + row] = s;
    }
}

#define GEMV(NAME, TY, IMPL, T) \
    extern "C" __global__ void gemv_##NAME##_##T(Matrices mats, int n_in, const float* x) { IMPL<TY, T>(mats, n_in, x); }
#define GEMV_ALL_T(NAME, TY, IMPL) GEMV(NAME, TY, IMPL, 1) GEMV(NAME, TY, IMPL, 2) GEMV(NAME, TY, IMPL, 4) GEMV(NAME, TY, IMPL, 8)
GEMV_ALL_T(f32, TY_F32, gemv_float)
GEMV_ALL_T(f16, TY_F16, gemv_float)
GEMV_ALL_T(bf16, TY_BF16, gemv_float)
GEMV_ALL_T(q8_0, TY_Q8_0, gemv)
GEMV_ALL_T(q4_0, TY_Q4_0, gemv)
GEMV_ALL_T(q4_1, TY_Q4_1, gemv)
GEMV_ALL_T(q4_k, TY_Q4_K, gemv)
GEMV_ALL_T(q6_k, TY_Q6_K, gemv)

// Whole-matrix dequantization to f16, for prefill through cuBLAS: one thread per 32-value chunk.
template <int TY>
__device__ void dequant_f16(Weight w, u16* out, int n_out) {
    u64 chunks = (u64)n_out * (w.n_in / 32);
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < chunks; g += (u64)gridDim.x * blockDim.x) {
        u64 row = g / (w.n_in / 32);
        int at0, at1;
        float y[32];
        chunk<TY>(w, row, (int)(g % (w.n_in / 32)), y, &at0, &at1);
        u16* o = out + row * w.n_in;
        for (int j = 0; j < 16; j++) {
            o[at0 + j] = f32_to_f16(y[j]);
            o[at1 + j] = f32_to_f16(y[16 + j]);
        }
    }
}

#define DEQUANT(NAME, TY) \
    extern "C" __global__ void dequant_f16_##NAME(const u8* q, const u8* s, const u8* m, int n_in, u16* out, int n_out) { \
        dequant_f16<TY>(Weight{q, s, m, n_in}, out, n_out); \
    }
DEQUANT(q8_0, TY_Q8_0)
DEQUANT(q4_0, TY_Q4_0)
DEQUANT(q4_1, TY_Q4_1)
DEQUANT(q4_k, TY_Q4_K)
DEQUANT(q6_k, TY_Q6_K)
