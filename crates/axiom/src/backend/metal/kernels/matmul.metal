// out[t, o] = sum_i x[t, i] * w[o, i] for a weight of any stored type, or out[t, o] += that with
// `accumulate` (the residual add in the epilogue). One simdgroup per output row: its lanes take
// the row's blocks in turn, decode them on the fly and reduce with simd_sum. The row is decoded
// once per token (decode runs one token; prompts run matmul_tiled.metal).

struct DotBlock {
    device const float* x;  // the activations under the block being visited
    float sum;
    void operator()(uint i, float w) { sum += w * x[i]; }
};

template <typename W>
void matmul_row(device const uchar* w, device const float* x, device float* out, uint n_in, uint n_out,
                uint n_tokens, uint accumulate, uint row, uint lane, uint lanes) {
    if (row >= n_out) return;  // the whole simdgroup leaves together
    uint n_blocks = n_in / W::block_len;
    device const uchar* wr = w + ulong(row) * n_blocks * W::block_bytes;
    for (uint t = 0; t < n_tokens; t++) {
        DotBlock dot = {x, 0.0f};
        for (uint b = lane; b < n_blocks; b += lanes) {
            dot.x = x + ulong(t) * n_in + b * W::block_len;
            visit<W>(wr + ulong(b) * W::block_bytes, dot);
        }
        float total = simd_sum(dot.sum);
        if (lane == 0) out[ulong(t) * n_out + row] = accumulate ? out[ulong(t) * n_out + row] + total : total;
    }
}

#define MATMUL(NAME, W)                                                                          \
    kernel void matmul_##NAME(device const uchar* w [[buffer(0)]], device const float* x [[buffer(1)]], \
                              device float* out [[buffer(2)]], constant uint& n_in [[buffer(3)]],       \
                              constant uint& n_out [[buffer(4)]], constant uint& n_tokens [[buffer(5)]], \
                              constant uint& accumulate [[buffer(6)]],                                   \
                              uint group [[threadgroup_position_in_grid]],                               \
                              uint simd [[simdgroup_index_in_threadgroup]],                              \
                              uint simds [[simdgroups_per_threadgroup]],                                 \
                              uint lane [[thread_index_in_simdgroup]],                                   \
                              uint lanes [[threads_per_simdgroup]]) {                                    \
        matmul_row<W>(w, x, out, n_in, n_out, n_tokens, accumulate, group * simds + simd, lane, lanes);  \
    }

MATMUL(f32, F32)
MATMUL(f16, F16)
MATMUL(bf16, BF16)
MATMUL(q8_0, Q8_0)
MATMUL(q4_0, Q4_0)
MATMUL(q4_1, Q4_1)
MATMUL(q5_0, Q5_0)
MATMUL(q4_k, Q4_K)
MATMUL(q6_k, Q6_K)
