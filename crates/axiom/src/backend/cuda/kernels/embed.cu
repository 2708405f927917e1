// out[t] = dequantize(table row ids[t]); one block per token.
template <int TY>
__device__ void embed(const u8* table, const u32* ids, float* out, int dim, u64 row_bytes) {
    int t = blockIdx.x;
    const u8* row = table + (u64)ids[t] * row_bytes;
    float y[32];
    for (int p = threadIdx.x; p < dim / 32; p += blockDim.x) {
        int sub;
        const u8* b = piece<TY>(row, p, &sub);
        Block<TY>::load(b, sub, y);
        for (int j = 0; j < 32; j++) out[(u64)t * dim + p * 32 + j] = y[j];
    }
}

#define EMBED(NAME, TY) \
    extern "C" __global__ void embed_##NAME(const u8* table, const u32* ids, float* out, int dim, u64 row_bytes) { \
        embed<TY>(table, ids, out, dim, row_bytes); \
    }
EMBED(f32, TY_F32)
EMBED(f16, TY_F16)
EMBED(bf16, TY_BF16)
EMBED(q8_0, TY_Q8_0)
EMBED(q4_0, TY_Q4_0)
EMBED(q4_1, TY_Q4_1)
EMBED(q4_k, TY_Q4_K)
EMBED(q6_k, TY_Q6_K)
