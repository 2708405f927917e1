// out[t, o] = sum_i x[t, i] * w[o, i] for a weight of any stored type, or out[t, o] += that with
// `accumulate` (the residual add in the epilogue). One simdgroup per output row: its lanes take
// the row's blocks in turn, decode them on the fly and reduce with simd_sum. The row is decoded
// once per token (decode runs one token; prompts run matmul_tiled.metal).
//
// With `normed`, x is first RMS-normalized, x[t] / rms(x[t]) * g (rms_norm.metal): every row
// reads all of x[t], so each simdgroup sums its squares on the way and scales its dot product,
// and the norm needs no dispatch of its own. matmul_glu_* multiplies the gate and up matrices at
// once and writes act(gate) * up (elementwise.metal's glu): the feed-forward block's first half
// in one dispatch. matmul_experts_* and matmul_glu_experts_* run a mixture's experts (below).

// The dot product of a lane's blocks of a row with x (x * g with NORMED), and x's squares.
template <bool NORMED>
struct DotBlock {
    device const float* x;  // the activations under the block being visited
    device const float* g;  // the norm's weight under it
    float sum, squares;
    void operator()(uint i, float w) {
        float v = x[i];
        if (NORMED) {
            squares += v * v;
            v *= g[i];
        }
        sum += w * v;
    }
};

template <typename W, bool NORMED>
DotBlock<NORMED> dot_lane(device const uchar* wr, device const float* xt, device const float* g, uint n_blocks,
                          uint lane, uint lanes) {
    DotBlock<NORMED> dot = {xt, g, 0.0f, 0.0f};
    for (uint b = lane; b < n_blocks; b += lanes) {
        dot.x = xt + b * W::block_len;
        dot.g = g + b * W::block_len;
        visit<W>(wr + ulong(b) * W::block_bytes, dot);
    }
    return dot;
}

// What a row's sums are multiplied by: 1, or the norm's 1 / rms from the squares of all lanes.
template <bool NORMED>
float row_scale(DotBlock<NORMED> dot, uint n_in, float eps) {
    return NORMED ? rsqrt(simd_sum(dot.squares) / float(n_in) + eps) : 1.0f;
}

template <typename W, bool NORMED>
void matmul_row(device const uchar* w, device const float* x, device const float* g, float eps, device float* out,
                uint n_in, uint n_out, uint n_tokens, uint accumulate, uint row, uint lane, uint lanes) {
    if (row >= n_out) return;  // the whole simdgroup leaves together
    uint n_blocks = n_in / W::block_len;
    device const uchar* wr = w + ulong(row) * n_blocks * W::block_bytes;
    for (uint t = 0; t < n_tokens; t++) {
        DotBlock<NORMED> dot = dot_lane<W, NORMED>(wr, x + ulong(t) * n_in, g, n_blocks, lane, lanes);
        float total = simd_sum(dot.sum) * row_scale(dot, n_in, eps);
        if (lane == 0) out[ulong(t) * n_out + row] = accumulate ? out[ulong(t) * n_out + row] + total : total;
    }
}

template <typename W, bool NORMED>
void matmul_glu_row(device const uchar* w_gate, device const uchar* w_up, device const float* x,
                    device const float* g, float eps, device float* out, uint n_in, uint n_out, uint n_tokens,
                    uint act, uint row, uint lane, uint lanes) {
    if (row >= n_out) return;
    uint n_blocks = n_in / W::block_len;
    ulong row_offset = ulong(row) * n_blocks * W::block_bytes;
    for (uint t = 0; t < n_tokens; t++) {
        device const float* xt = x + ulong(t) * n_in;
        DotBlock<NORMED> gate = dot_lane<W, NORMED>(w_gate + row_offset, xt, g, n_blocks, lane, lanes);
        DotBlock<NORMED> up = dot_lane<W, NORMED>(w_up + row_offset, xt, g, n_blocks, lane, lanes);
        float scale = row_scale(gate, n_in, eps);
        float a = activate(simd_sum(gate.sum) * scale, act), u = simd_sum(up.sum) * scale;
        if (lane == 0) out[ulong(t) * n_out + row] = a * u;
    }
}

// A mixture's experts, one grid row per (token, choice) pair: pair p multiplies row p / per_x of x
// (per_x is k for the tokens' rows, 1 for rows per pair) by expert ids[p] of the n_experts
// stacked expert_bytes apart, into row p of out, so only the chosen experts' rows are read;
// matmul_glu_experts_* does so for the gate and up stacks at once and writes act(gate) * up. An
// id outside the set writes NaN: the device cannot raise an error, and a NaN output is not missed.
struct ExpertPair {
    ulong offset;            // the chosen expert's first byte in its stack
    device const float* x;   // the pair's input row
    device float* out;       // the pair's output row
    bool valid;
};

inline ExpertPair expert_pair(uint expert_bytes, uint n_experts, device const uint* ids, uint per_x,
                              device const float* x, device float* out, uint n_in, uint n_out, uint pair, uint row,
                              uint lane) {
    uint e = ids[pair];
    ExpertPair p = {ulong(e) * expert_bytes, x + ulong(pair / per_x) * n_in, out + ulong(pair) * n_out,
                    e < n_experts};
    if (!p.valid && row < n_out && lane == 0) p.out[row] = NAN;
    return p;
}

// `g` is read only where `normed` is set (bind any buffer otherwise).
#define MATMUL(NAME, W)                                                                                   \
    kernel void matmul_##NAME(device const uchar* w [[buffer(0)]], device const float* x [[buffer(1)]],       \
                              device float* out [[buffer(2)]], constant uint& n_in [[buffer(3)]],             \
                              constant uint& n_out [[buffer(4)]], constant uint& n_tokens [[buffer(5)]],       \
                              constant uint& accumulate [[buffer(6)]], device const float* g [[buffer(7)]],    \
                              constant float& eps [[buffer(8)]], constant uint& normed [[buffer(9)]],          \
                              uint group [[threadgroup_position_in_grid]],                                     \
                              uint simd [[simdgroup_index_in_threadgroup]],                                    \
                              uint simds [[simdgroups_per_threadgroup]],                                       \
                              uint lane [[thread_index_in_simdgroup]],                                         \
                              uint lanes [[threads_per_simdgroup]]) {                                          \
        uint row = group * simds + simd;                                                                       \
        if (normed)                                                                                            \
            matmul_row<W, true>(w, x, g, eps, out, n_in, n_out, n_tokens, accumulate, row, lane, lanes);       \
        else                                                                                                   \
            matmul_row<W, false>(w, x, g, eps, out, n_in, n_out, n_tokens, accumulate, row, lane, lanes);      \
    }                                                                                                          \
    kernel void matmul_glu_##NAME(device const uchar* w_gate [[buffer(0)]], device const uchar* w_up [[buffer(1)]], \
                                  device const float* x [[buffer(2)]], device float* out [[buffer(3)]],         \
                                  constant uint& n_in [[buffer(4)]], constant uint& n_out [[buffer(5)]],        \
                                  constant uint& n_tokens [[buffer(6)]], constant uint& act [[buffer(7)]],      \
                                  device const float* g [[buffer(8)]], constant float& eps [[buffer(9)]],      \
                                  constant uint& normed [[buffer(10)]],                                        \
                                  uint group [[threadgroup_position_in_grid]],                                 \
                                  uint simd [[simdgroup_index_in_threadgroup]],                                \
                                  uint simds [[simdgroups_per_threadgroup]],                                   \
                                  uint lane [[thread_index_in_simdgroup]],                                     \
                                  uint lanes [[threads_per_simdgroup]]) {                                      \
        uint row = group * simds + simd;                                                                       \
        if (normed)                                                                                            \
            matmul_glu_row<W, true>(w_gate, w_up, x, g, eps, out, n_in, n_out, n_tokens, act, row, lane, lanes); \
        else                                                                                                   \
            matmul_glu_row<W, false>(w_gate, w_up, x, g, eps, out, n_in, n_out, n_tokens, act, row, lane, lanes); \
    }                                                                                                          \
    kernel void matmul_experts_##NAME(device const uchar* w [[buffer(0)]], device const uint* ids [[buffer(1)]],  \
                                      device const float* x [[buffer(2)]], device float* out [[buffer(3)]],     \
                                      constant uint& n_in [[buffer(4)]], constant uint& n_out [[buffer(5)]],    \
                                      constant uint& expert_bytes [[buffer(6)]],                                \
                                      constant uint& n_experts [[buffer(7)]], constant uint& per_x [[buffer(8)]], \
                                      uint2 group [[threadgroup_position_in_grid]],                             \
                                      uint simd [[simdgroup_index_in_threadgroup]],                             \
                                      uint simds [[simdgroups_per_threadgroup]],                                \
                                      uint lane [[thread_index_in_simdgroup]],                                  \
                                      uint lanes [[threads_per_simdgroup]]) {                                   \
        uint row = group.x * simds + simd;                                                                     \
        ExpertPair p = expert_pair(expert_bytes, n_experts, ids, per_x, x, out, n_in, n_out, group.y, row, lane);  \
        if (p.valid) matmul_row<W, false>(w + p.offset, p.x, p.x, 0.0f, p.out, n_in, n_out, 1, 0, row, lane, lanes);  \
    }                                                                                                          \
    kernel void matmul_glu_experts_##NAME(                                                                     \
        device const uchar* w_gate [[buffer(0)]], device const uchar* w_up [[buffer(1)]],                      \
        device const uint* ids [[buffer(2)]], device const float* x [[buffer(3)]], device float* out [[buffer(4)]], \
        constant uint& n_in [[buffer(5)]], constant uint& n_out [[buffer(6)]],                                 \
        constant uint& expert_bytes [[buffer(7)]], constant uint& n_experts [[buffer(8)]],                     \
        constant uint& per_x [[buffer(9)]], constant uint& act [[buffer(10)]],                                 \
        uint2 group [[threadgroup_position_in_grid]], uint simd [[simdgroup_index_in_threadgroup]],             \
        uint simds [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],                    \
        uint lanes [[threads_per_simdgroup]]) {                                                                \
        uint row = group.x * simds + simd;                                                                     \
        ExpertPair p = expert_pair(expert_bytes, n_experts, ids, per_x, x, out, n_in, n_out, group.y, row, lane);  \
        if (p.valid)                                                                                           \
            matmul_glu_row<W, false>(w_gate + p.offset, w_up + p.offset, p.x, p.x, 0.0f, p.out, n_in, n_out, 1, act, \
                                     row, lane, lanes);                                                        \
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
MATMUL(fp8, FP8_E4M3)
