// out[t] = dequantize(table row ids[t]). One threadgroup per token; its threads take the row's
// blocks in turn.

struct StoreBlock {
    device float* out;  // where the block being visited goes
    void operator()(uint i, float v) { out[i] = v; }
};

template <typename W>
void embed_row(device const uchar* table, device const uint* ids, device float* out, uint dim, uint t, uint tid,
               uint threads) {
    uint n_blocks = dim / W::block_len;
    device const uchar* row = table + ulong(ids[t]) * n_blocks * W::block_bytes;
    for (uint b = tid; b < n_blocks; b += threads) {
        StoreBlock store = {out + ulong(t) * dim + b * W::block_len};
        visit<W>(row + ulong(b) * W::block_bytes, store);
    }
}

#define EMBED(NAME, W)                                                                                  \
    kernel void embed_##NAME(device const uchar* table [[buffer(0)]], device const uint* ids [[buffer(1)]], \
                             device float* out [[buffer(2)]], constant uint& dim [[buffer(3)]],              \
                             uint t [[threadgroup_position_in_grid]],                                        \
                             uint tid [[thread_position_in_threadgroup]],                                    \
                             uint threads [[threads_per_threadgroup]]) {                                     \
        embed_row<W>(table, ids, out, dim, t, tid, threads);                                                 \
    }

EMBED(f32, F32)
EMBED(f16, F16)
EMBED(bf16, BF16)
EMBED(q8_0, Q8_0)
EMBED(q4_0, Q4_0)
EMBED(q4_1, Q4_1)
EMBED(q5_0, Q5_0)
EMBED(q4_k, Q4_K)
EMBED(q6_k, Q6_K)
EMBED(fp8, FP8_E4M3)
