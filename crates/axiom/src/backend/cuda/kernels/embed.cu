// out[t] = dequantize(table row ids[t]); one block per token, one thread per 32-value chunk.
template <int TY>
__device__ void embed(Weight w, const u32* ids, float* out) {
    begin_after_inputs();
    int t = blockIdx.x;
    u64 row = ids[t];
    float y[32];
    for (int c = threadIdx.x; c < w.n_in / 32; c += blockDim.x) {
        int at0, at1;
        chunk<TY>(w, row, c, y, &at0, &at1);
        float* o = out + (u64)t * w.n_in;
        for (int j = 0; j < 16; j++) {
            o[at0 + j] = y[j];
            o[at1 + j] = y[16 + j];
        }
    }
}

#define EMBED(NAME, TY) \
    extern "C" __global__ void embed_##NAME(EmbedParams p) { \
        embed<TY>(Weight{p.q, p.s, p.m, p.n_in}, p.ids, p.out); \
    }
EMBED(f32, TY_F32)
EMBED(f16, TY_F16)
EMBED(bf16, TY_BF16)
EMBED(q8_0, TY_Q8_0)
EMBED(q4_0, TY_Q4_0)
EMBED(q4_1, TY_Q4_1)
EMBED(q5_0, TY_Q5_0)
EMBED(q4_k, TY_Q4_K)
EMBED(q6_k, TY_Q6_K)
EMBED(fp8, TY_FP8)
