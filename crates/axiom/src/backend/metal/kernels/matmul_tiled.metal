// out[t, o] = sum_i x[t, i] * w[o, i] for prompts, or out[t, o] += that with `accumulate` (as
// matmul.metal). A threadgroup of four simdgroups computes a
// tile of TILE_T tokens by TILE_O output rows: for each slice of TILE_K inner values it stages the
// tile's activations and its weights, decoded once for all TILE_T tokens, in threadgroup memory,
// and each simdgroup multiplies its 16 rows for all tokens in 8x8 simdgroup matrices. Staged
// values past the sizes are zeros; only results inside them are written.

enum { TILE_T = 32, TILE_O = 64, TILE_K = 32, TILE_SIMDS = 4 };
// Each simdgroup's rows: two 8-wide matrices. The weight tile also holds the results at the end.
enum { SIMD_ROWS = TILE_O / TILE_SIMDS };
static_assert(SIMD_ROWS == 16 && TILE_T * TILE_O == TILE_K * TILE_O, "the tile shapes the code assumes");

// Puts a visited sub-block into column `first`'s place of the transposed weight tile ([k][o]).
struct StoreWeights {
    threadgroup float* dst;  // the tile's column of this row, at the sub-block's first value
    uint first;              // the sub-block's first index within its block
    void operator()(uint i, float v) { dst[(i - first) * TILE_O] = v; }
};

template <typename W>
void matmul_tiled(device const uchar* w, device const float* x, device float* out, uint n_in, uint n_out,
                  uint n_tokens, uint accumulate, uint2 tile, uint tid, uint threads, uint simd, threadgroup float* xs,
                  threadgroup float* ws) {
    uint t0 = tile.y * TILE_T, o0 = tile.x * TILE_O;
    ulong row_bytes = ulong(n_in / W::block_len) * W::block_bytes;
    const uint subs = TILE_K / uint(W::sub_len);  // sub-blocks of a row in a slice
    simdgroup_float8x8 acc[4][2];
    for (uint i = 0; i < 4; i++)
        for (uint j = 0; j < 2; j++) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    for (uint k0 = 0; k0 < n_in; k0 += TILE_K) {
        for (uint e = tid; e < TILE_T * TILE_K; e += threads) {
            uint t = t0 + e / TILE_K, k = k0 + e % TILE_K;
            xs[e] = t < n_tokens && k < n_in ? x[ulong(t) * n_in + k] : 0.0f;
        }
        // A unit is one sub-block of one row; n_in is a whole number of blocks, so a unit is
        // either all inside it or all past it.
        for (uint u = tid; u < TILE_O * subs; u += threads) {
            uint r = u / subs, k = k0 + (u % subs) * W::sub_len;
            threadgroup float* dst = ws + (k - k0) * TILE_O + r;
            if (o0 + r < n_out && k < n_in) {
                StoreWeights store = {dst, k % W::block_len};
                device const uchar* block = w + (o0 + r) * row_bytes + ulong(k / W::block_len) * W::block_bytes;
                W::visit_sub(block, k % W::block_len / W::sub_len, store);
            } else {
                for (uint i = 0; i < W::sub_len; i++) dst[i * TILE_O] = 0.0f;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < TILE_K; kk += 8) {
            simdgroup_float8x8 a[4], b[2];
            for (uint i = 0; i < 4; i++) simdgroup_load(a[i], xs + 8 * i * TILE_K + kk, TILE_K);
            for (uint j = 0; j < 2; j++) simdgroup_load(b[j], ws + kk * TILE_O + SIMD_ROWS * simd + 8 * j, TILE_O);
            for (uint i = 0; i < 4; i++)
                for (uint j = 0; j < 2; j++) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the next slice overwrites the tiles
    }

    // The results go through the weight tile, no longer read, so that edges are written alone.
    for (uint i = 0; i < 4; i++)
        for (uint j = 0; j < 2; j++) simdgroup_store(acc[i][j], ws + 8 * i * TILE_O + SIMD_ROWS * simd + 8 * j, TILE_O);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < TILE_T * TILE_O; e += threads) {
        uint t = t0 + e / TILE_O, o = o0 + e % TILE_O;
        if (t < n_tokens && o < n_out) out[ulong(t) * n_out + o] = accumulate ? out[ulong(t) * n_out + o] + ws[e] : ws[e];
    }
}

// The grid is (n_out / TILE_O, n_tokens / TILE_T) rounded up, TILE_SIMDS simdgroups of 32 each.
#define MATMUL_TILED(NAME, W)                                                                                  \
    kernel void matmul_tiled_##NAME(device const uchar* w [[buffer(0)]], device const float* x [[buffer(1)]], \
                                    device float* out [[buffer(2)]], constant uint& n_in [[buffer(3)]],       \
                                    constant uint& n_out [[buffer(4)]], constant uint& n_tokens [[buffer(5)]], \
                                    constant uint& accumulate [[buffer(6)]],                                   \
                                    uint2 tile [[threadgroup_position_in_grid]],                               \
                                    uint tid [[thread_index_in_threadgroup]],                                  \
                                    uint2 group_size [[threads_per_threadgroup]],                              \
                                    uint simd [[simdgroup_index_in_threadgroup]]) {                            \
        threadgroup float xs[TILE_T * TILE_K];                                                                 \
        threadgroup float ws[TILE_K * TILE_O];                                                                 \
        matmul_tiled<W>(w, x, out, n_in, n_out, n_tokens, accumulate, tile, tid, group_size.x, simd, xs, ws);  \
    }

MATMUL_TILED(f32, F32)
MATMUL_TILED(f16, F16)
MATMUL_TILED(bf16, BF16)
MATMUL_TILED(q8_0, Q8_0)
MATMUL_TILED(q4_0, Q4_0)
MATMUL_TILED(q4_1, Q4_1)
MATMUL_TILED(q5_0, Q5_0)
MATMUL_TILED(q4_k, Q4_K)
MATMUL_TILED(q6_k, Q6_K)
MATMUL_TILED(fp8, FP8_E4M3)
