// Matrix-vector products for decode, straight from the stored weight type: out[t, o] =
// sum_i x[t, i] * w[o, i] for T tokens at once. One warp per output row; the lanes take the
// row's 32-value pieces in turn, so a warp streams its row once for all T tokens.
template <int TY, int T>
__device__ void gemv(const u8* w, const float* x, float* out, int n_in, int n_out, u64 row_bytes) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n_out) return;
    const u8* wrow = w + (u64)row * row_bytes;
    float acc[T];
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    float y[32];
    for (int p = lane; p < n_in / 32; p += 32) {
        int sub;
        Block<TY>::load(piece<TY>(wrow, p, &sub), sub, y);
        for (int t = 0; t < T; t++) {
            const float4* xp = (const float4*)(x + (u64)t * n_in + p * 32);
            float s = 0.0f;
            for (int j = 0; j < 8; j++) {
                float4 v = xp[j];
                s += y[4 * j] * v.x + y[4 * j + 1] * v.y + y[4 * j + 2] * v.z + y[4 * j + 3] * v.w;
            }
            acc[t] += s;
        }
    }
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * n_out + row] = s;
    }
}

// Float weights: lane-interleaved 16-byte loads, so each warp load is 512 contiguous bytes.
template <int TY, int T>
__device__ void gemv_float(const u8* w, const float* x, float* out, int n_in, int n_out, u64 row_bytes) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n_out) return;
    const u8* wrow = w + (u64)row * row_bytes;
    float acc[T];
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    constexpr int PER = TY == TY_F32 ? 4 : 8;  // values per 16-byte load
    for (int i = lane * PER; i < n_in; i += 32 * PER) {
        uint4 raw = *(const uint4*)(wrow + (u64)i * (TY == TY_F32 ? 4 : 2));
        float y[8];
        u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
        if (TY == TY_F32) {
            for (int k = 0; k < 4; k++) y[k] = __uint_as_float(words[k]);
        } else {
            for (int k = 0; k < 4; k++) {
                y[2 * k] = TY == TY_BF16 ? __uint_as_float(words[k] << 16) : f16_to_f32((u16)(words[k] & 0xffff));
                y[2 * k + 1] = TY == TY_BF16 ? __uint_as_float(words[k] & 0xffff0000u) : f16_to_f32((u16)(words[k] >> 16));
            }
        }
        for (int t = 0; t < T; t++) {
            const float* xt = x + (u64)t * n_in + i;
            float s = 0.0f;
            for (int k = 0; k < PER; k++) s += y[k] * xt[k];
            acc[t] += s;
        }
    }
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * n_out + row] = s;
    }
}

#define GEMV(NAME, TY, IMPL, T) \
    extern "C" __global__ void gemv_##NAME##_##T(const u8* w, const float* x, float* out, int n_in, int n_out, \
                                                  u64 row_bytes) { \
        IMPL<TY, T>(w, x, out, n_in, n_out, row_bytes); \
    }
#define GEMV_ALL_T(NAME, TY, IMPL) GEMV(NAME, TY, IMPL, 1) GEMV(NAME, TY, IMPL, 2) GEMV(NAME, TY, IMPL, 4) GEMV(NAME, TY, IMPL, 8)
GEMV_ALL_T(f32, TY_F32, gemv_float)
GEMV_ALL_T(f16, TY_F16, gemv_float)
GEMV_ALL_T(bf16, TY_BF16, gemv_float)
GEMV_ALL_T(q8_0, TY_Q8_0, gemv)
GEMV_ALL_T(q4_0, TY_Q4_0, gemv)
GEMV_ALL_T(q4_1, TY_Q4_1, gemv)
GEMV_ALL_T(q4_k, TY_Q4_K, gemv)
GEMV_ALL_T(q6_k, TY_Q6_K, gemv)

// Whole-matrix dequantization to f16, for prefill through cuBLAS: one thread per 32-value piece.
template <int TY>
__device__ void dequant_f16(const u8* w, u16* out, int n_in, int n_out, u64 row_bytes) {
    u64 pieces = (u64)n_out * (n_in / 32);
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < pieces; g += (u64)gridDim.x * blockDim.x) {
        u64 row = g / (n_in / 32);
        int p = (int)(g % (n_in / 32)), sub;
        float y[32];
        Block<TY>::load(piece<TY>(w + row * row_bytes, p, &sub), sub, y);
        for (int j = 0; j < 32; j++) out[row * n_in + p * 32 + j] = f32_to_f16(y[j]);
    }
}

#define DEQUANT(NAME, TY) \
    extern "C" __global__ void dequant_f16_##NAME(const u8* w, u16* out, int n_in, int n_out, u64 row_bytes) { \
        dequant_f16<TY>(w, out, n_in, n_out, row_bytes); \
    }
DEQUANT(q8_0, TY_Q8_0)
DEQUANT(q4_0, TY_Q4_0)
DEQUANT(q4_1, TY_Q4_1)
DEQUANT(q4_k, TY_Q4_K)
DEQUANT(q6_k, TY_Q6_K)
