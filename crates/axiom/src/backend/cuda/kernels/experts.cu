// Mixture-of-experts ops (cuda/experts.rs). `route` leaves each token's chosen experts on the
// device and every kernel after it reads them there: no trip to the host between the router and
// the experts, so a decode step's graph holds the whole block.

// Each token's k experts from its router logits, as cpu/kernels/route.rs chooses them: a softmax
// over the n_experts, the k most probable, the lowest index first among equals, their
// probabilities divided by their sum with `renormalize`. One warp a token, eight a block. Pick j is
// the best expert ranked after pick j - 1 (probability descending, then index ascending), so
// nothing needs marking as taken.
//
// A lane holds the probabilities of experts lane, lane + 32, ... (PER of them) in registers, each
// as a key that orders them as the picks do: its probability's bits above its index's complement
// (probabilities are never negative, so their bits order as they do), so each pick is one warp
// maximum over the keys below the last pick's. Every lane adds each pick's probability as it is
// made, so the sum for `renormalize` is taken in pick order as on the CPU; lane j keeps pick j,
// and the picks are stored at once. The logits are read from L2 (__ldcg): router_route's last
// block reads those other blocks wrote.
template <int PER> __device__ __forceinline__ void route_token_in(const RouteParams& p, int token) {
    int lane = threadIdx.x % 32, n = p.n_experts, k = p.k;
    const float* row = p.logits + (u64)token * n;
    float prob[PER];
    float top = __int_as_float(0xff800000u);
#pragma unroll
    for (int i = 0; i < PER; i++) {
        int e = lane + 32 * i;
        prob[i] = e < n ? __ldcg(row + e) : top;
        top = fmaxf(top, prob[i]);
    }
    top = warp_max(top);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        prob[i] = lane + 32 * i < n ? expf(prob[i] - top) : 0.0f;
        sum += prob[i];
    }
    sum = warp_sum(sum);
    u64 key[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        u32 e = lane + 32 * i;
        // Past the experts, key 0: below every expert's (its index's complement is not 0).
        key[i] = e < (u32)n ? (u64)__float_as_uint(prob[i] / sum) << 32 | ~e : 0;
    }
    u64 last = ~0ull, mine = 0;
    float chosen = 0.0f;
    for (int j = 0; j < k; j++) {
        u64 best = 0;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (key[i] < last && key[i] > best) best = key[i];
        for (int o = 16; o > 0; o >>= 1) {
            u64 other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        last = best;
        chosen += __uint_as_float((u32)(best >> 32));
        if (lane == j) mine = best;
    }
    if (lane < k) {
        float weight = __uint_as_float((u32)(mine >> 32));
        p.ids[(u64)token * k + lane] = ~(u32)mine;
        p.weights[(u64)token * k + lane] = p.renormalize ? weight / chosen : weight;
    }
}

// route_token_in with as many values a lane as the experts need (ROUTE_MAX_EXPERTS at most): a
// lane's scan of its keys is most of a pick's work.
__device__ __forceinline__ void route_token(const RouteParams& p, int token) {
    int per = (p.n_experts + 31) / 32;
    if (per <= 1) route_token_in<1>(p, token);
    else if (per <= 2) route_token_in<2>(p, token);
    else if (per <= 4) route_token_in<4>(p, token);
    else if (per <= 8) route_token_in<8>(p, token);
    else route_token_in<16>(p, token);
}

extern "C" __global__ void route(RouteParams p) {
    begin_after_inputs();
    int token = blockIdx.x * 8 + threadIdx.x / 32;
    if (token < p.n_tokens) route_token(p, token);
}

// Small steps' router product and routing in one launch. The router's rows are short for a warp
// each, so a block takes ROUTER_ROWS of them for every token and all its threads split each row,
// their sums meeting in shared memory in a fixed order; the router's weights are loaded before the
// wait (no step writes them). The last block to finish (`done` counts them, and that block puts it
// back to zero) routes the tokens, a warp each, as `route` does.
#define ROUTER_ROWS 2
#define ROUTER_LOADS 2   // 16-byte loads a thread of a row held at once
#define ROUTER_TOKENS 8  // the most a launch takes (PAIRWISE_MAX_TOKENS in cuda/experts.rs)
template <int TY> __device__ __forceinline__ void router_route(const RouterRouteParams& p) {
    __shared__ float sums[8][ROUTER_ROWS][ROUTER_TOKENS];
    __shared__ bool last;
    constexpr int PER = 16 / ValueBytes<TY>::value;  // values a load
    const RouteParams& r = p.route;
    int n_in = p.n_in, n_loads = n_in / PER, n_tokens = r.n_tokens, first = blockIdx.x * ROUTER_ROWS;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, stride = blockDim.x;
    const uint4* rows = (const uint4*)(p.w + (u64)first * n_in * ValueBytes<TY>::value);
    auto load = [&](uint4 (&raw)[ROUTER_ROWS][ROUTER_LOADS], int base) {
#pragma unroll
        for (int j = 0; j < ROUTER_ROWS; j++)
#pragma unroll
            for (int u = 0; u < ROUTER_LOADS; u++) {
                int i = base + u * stride + threadIdx.x;
                raw[j][u] = i < n_loads && first + j < r.n_experts ? load_stream(rows + (u64)j * n_loads + i)
                                                                   : make_uint4(0, 0, 0, 0);
            }
    };
    uint4 raw[ROUTER_ROWS][ROUTER_LOADS];
    load(raw, 0);
    begin_after_inputs();
    float acc[ROUTER_ROWS][ROUTER_TOKENS] = {};
    Fp8Scales none{};
    for (int base = 0; base < n_loads; base += stride * ROUTER_LOADS) {
        if (base > 0) load(raw, base);
#pragma unroll
        for (int j = 0; j < ROUTER_ROWS; j++)
#pragma unroll
            for (int u = 0; u < ROUTER_LOADS; u++) {
                int i = base + u * stride + threadIdx.x;
#pragma unroll
                for (int t = 0; t < ROUTER_TOKENS; t++)
                    if (t < n_tokens && i < n_loads)
                        dot_load<TY, 1>(raw[j][u], p.x + (u64)t * n_in, n_in, i * PER, none, &acc[j][t]);
            }
    }
#pragma unroll
    for (int j = 0; j < ROUTER_ROWS; j++)
#pragma unroll
        for (int t = 0; t < ROUTER_TOKENS; t++) {
            float v = warp_sum(acc[j][t]);
            if (lane == 0) sums[warp][j][t] = v;
        }
    __syncthreads();
    int j = threadIdx.x / ROUTER_TOKENS, t = threadIdx.x % ROUTER_TOKENS;
    if (j < ROUTER_ROWS && t < n_tokens && first + j < r.n_experts) {
        float logit = 0.0f;
        for (int w = 0; w < blockDim.x / 32; w++) logit += sums[w][j][t];
        ((float*)r.logits)[(u64)t * r.n_experts + first + j] = logit;  // what the routing reads
    }
    __threadfence();  // this block's logits are visible before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(p.done, 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int token = warp; token < n_tokens; token += blockDim.x / 32) route_token(r, token);
    if (threadIdx.x == 0) *p.done = 0;
}
extern "C" __global__ void router_route_f32(RouterRouteParams p) { router_route<TY_F32>(p); }
extern "C" __global__ void router_route_f16(RouterRouteParams p) { router_route<TY_F16>(p); }
extern "C" __global__ void router_route_bf16(RouterRouteParams p) { router_route<TY_BF16>(p); }

// The expert products run on the matrix-vector kernels' row dot products (matmul.cu): a warp takes
// a row of an expert's matrix and leaves its lanes' partial sums for T input rows. `Rows` picks
// float_row or quant_row by the weights' type.
template <int TY> struct FloatRows {
    template <int T> __device__ __forceinline__ static void dot(const Weight& w, int row, const float* x, float* acc) {
        float_row<TY, T>(w, row, x, acc);
    }
};
template <int TY> struct QuantRows {
    template <int T> __device__ __forceinline__ static void dot(const Weight& w, int row, const float* x, float* acc) {
        quant_row<TY, T>(w, row, x, acc);
    }
};

__device__ __forceinline__ Weight expert_weight(const ExpertWeights& w, u32 e, int n_in) {
    return Weight{w.q + e * w.q_stride, w.s + e * w.s_stride, w.m + e * w.m_stride, n_in};
}

// Row `row` of T consecutive input rows `x` times expert matrix w (with GLU, also times up, and
// act(gate) * up written): output row t at out + t * n_out.
template <typename Rows, bool GLU, int T>
__device__ __forceinline__ void expert_tile(const ExpertProductParams& p, const Weight& w, const Weight& up, int row,
                                            const float* x, float* out) {
    float g[T], u[T];
    Rows::template dot<T>(w, row, x, g);
    if (GLU) Rows::template dot<T>(up, row, x, u);
    for (int t = 0; t < T; t++) {
        g[t] = warp_sum(g[t]);
        if (GLU) u[t] = warp_sum(u[t]);
    }
    if (threadIdx.x % 32 == 0)
        for (int t = 0; t < T; t++) out[(u64)t * p.n_out] = GLU ? glu_of(g[t], u[t], p.act) : g[t];
}

// Small steps: a block's eight warps take eight rows of one (token, expert) pair's matrix (the
// pair is blockIdx.y), so only the chosen experts' rows are read. A pair whose id is outside the
// set gets NaN rows.
template <typename Rows, bool GLU>
__device__ __forceinline__ void expert_rows(const ExpertProductParams& p) {
    begin_after_inputs();
    int row = blockIdx.x * 8 + threadIdx.x / 32, pair = blockIdx.y;
    if (row >= p.n_out) return;
    u32 e = p.ids[pair];
    float* out = p.out + (u64)pair * p.n_out + row;
    if (e >= (u32)p.n_experts) {
        if (threadIdx.x % 32 == 0) *out = __int_as_float(0x7fc00000u);
        return;
    }
    Weight w = expert_weight(p.w, e, p.n_in), up = GLU ? expert_weight(p.up, e, p.n_in) : w;
    expert_tile<Rows, GLU, 1>(p, w, up, row, p.x + (u64)(pair / p.rows_per_token) * p.n_in, out);
}

// Larger steps, over the pairs grouped by expert (group_pairs): a block's eight warps take eight
// rows of expert blockIdx.y's matrix for all of that expert's slots, eight at a time, so each row
// comes from memory once and from cache for the tiles after the first.
template <typename Rows, bool GLU>
__device__ __forceinline__ void expert_groups(const ExpertProductParams& p) {
    begin_after_inputs();
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    u32 e = blockIdx.y;
    if (row >= p.n_out) return;
    u32 s = p.offsets[e], end = p.offsets[e + 1];
    Weight w = expert_weight(p.w, e, p.n_in), up = GLU ? expert_weight(p.up, e, p.n_in) : w;
    auto x = [&](u32 slot) { return p.x + (u64)slot * p.n_in; };
    auto out = [&](u32 slot) { return p.out + (u64)slot * p.n_out + row; };
    for (; s + 8 <= end; s += 8) expert_tile<Rows, GLU, 8>(p, w, up, row, x(s), out(s));
    if (s + 4 <= end) expert_tile<Rows, GLU, 4>(p, w, up, row, x(s), out(s)), s += 4;
    if (s + 2 <= end) expert_tile<Rows, GLU, 2>(p, w, up, row, x(s), out(s)), s += 2;
    if (s < end) expert_tile<Rows, GLU, 1>(p, w, up, row, x(s), out(s));
}

// Small steps' down products fused with their weighted sum into the residual: a block takes
// `groups * R` output rows of token blockIdx.y, and its warps one (pick, R rows) task each, the
// picks in rounds of up to eight; after each round a thread a row adds the round's sums in pick
// order, as experts_sum does, so the result is the same bit for bit, with no trip of the k rows
// through memory and no launch of its own. `dot(w, row, n_rows, pair, part)` leaves a warp's
// per-lane partial sums of rows row.. of w with pair's hidden row. NaN where an id is outside the
// set.
template <int R, typename Dot>
__device__ __forceinline__ void expert_down_sum(const ExpertDownSumParams& p, Dot dot) {
    __shared__ float sums[8][R];
    begin_after_inputs();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = p.k, groups = p.groups;
    int per_round = min(k, 8), token = blockIdx.y, first = blockIdx.x * groups * R;
    int mine = first + threadIdx.x;  // the row this thread adds, if any
    bool adds = threadIdx.x < groups * R && mine < p.n_out;
    float* residual = p.residual + (u64)token * p.n_out + mine;
    float acc = adds ? *residual : 0.0f;
    bool bad = false;
    for (int j0 = 0; j0 < k; j0 += per_round) {
        int j = j0 + warp % per_round, row = first + warp / per_round * R;
        if (warp / per_round < groups && j < k && row < p.n_out) {
            u64 pair = (u64)token * k + j;
            u32 e = p.ids[pair];
            if (e < (u32)p.n_experts) {  // else the adders skip this pick
                float part[R];
                dot(expert_weight(p.w, e, p.n_in), row, min(R, p.n_out - row), pair, part);
                for (int r = 0; r < R; r++) part[r] = warp_sum(part[r]);
                if (lane == 0)
                    for (int r = 0; r < R; r++) sums[warp][r] = part[r];
            }
        }
        __syncthreads();
        if (adds) {
            int g = threadIdx.x / R, r = threadIdx.x % R;
            for (int i = 0; i < min(per_round, k - j0); i++) {
                u64 pair = (u64)token * k + j0 + i;
                if (p.ids[pair] >= (u32)p.n_experts) {
                    bad = true;
                    continue;
                }
                acc += p.weights[pair] * sums[g * per_round + i][r];
            }
        }
        __syncthreads();  // the sums are read before the next round writes them
    }
    if (adds) *residual = bad ? __int_as_float(0x7fc00000u) : acc;
}

template <typename Rows>
__device__ __forceinline__ void expert_down_sum_f32(const ExpertDownSumParams& p) {
    expert_down_sum<1>(p, [&](const Weight& w, int row, int, u64 pair, float* part) {
        Rows::template dot<1>(w, row, p.x + pair * p.n_in, part);
    });
}

// Gate and up products of one quantized type on int8 activations (quantize_q8: each token's row
// in the layout the integer matrix-vector kernels read), by their row dot products (int_row in
// matmul.cu), act(gate) * up written: a warp takes a row of gate and the same row of up (Q4_K's
// in one pass, paired as in its one-token matrix-vector kernel). Token t's values start at
// t * n_in of xq, its scales at t * n_in / 32 of xd (twice that where interleaved, each scale
// with its block's sum: Q4_K's and Q6_K's).
template <int TY>
__device__ __forceinline__ const float* int_scales(const float* xd, u64 t, int n_in) {
    return xd + t * (n_in / 32) * (InterleavesActivations<TY>::value ? 2 : 1);
}

template <int TY>
__device__ __forceinline__ void expert_rows_int_glu(const ExpertProductParams& p) {
    begin_after_inputs();
    int row = blockIdx.x * 8 + threadIdx.x / 32, pair = blockIdx.y;
    if (row >= p.n_out) return;
    u32 e = p.ids[pair];
    float* out = p.out + (u64)pair * p.n_out + row;
    if (e >= (u32)p.n_experts) {
        if (threadIdx.x % 32 == 0) *out = __int_as_float(0x7fc00000u);
        return;
    }
    Weight w = expert_weight(p.w, e, p.n_in), up = expert_weight(p.up, e, p.n_in);
    u64 token = pair / p.rows_per_token;
    const i8* xq = p.xq + token * p.n_in;
    const float* xd = int_scales<TY>(p.xd, token, p.n_in);
    auto none = [] {};
    float acc[2];  // gate's sum, then up's
    if constexpr (RowsPerWarp<TY, 1>::value == 2) {
        int_row<TY, 1, true>(w, up, row, 1, xq, xd, acc, none, false);
    } else {
        int_row<TY, 1, false>(w, w, row, 1, xq, xd, acc, none, false);
        int_row<TY, 1, false>(up, up, row, 1, xq, xd, acc + 1, none, false);
    }
    float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    if (threadIdx.x % 32 == 0) *out = glu_of(g, u, p.act);
}

#define EXPERT_PRODUCTS(NAME, ROWS)                                                                                    \
    extern "C" __global__ void expert_rows_##NAME(ExpertProductParams p) { expert_rows<ROWS, false>(p); }             \
    extern "C" __global__ void expert_rows_glu_##NAME(ExpertProductParams p) { expert_rows<ROWS, true>(p); }          \
    extern "C" __global__ void expert_groups_##NAME(ExpertProductParams p) { expert_groups<ROWS, false>(p); }         \
    extern "C" __global__ void expert_groups_glu_##NAME(ExpertProductParams p) { expert_groups<ROWS, true>(p); }    \
    extern "C" __global__ void expert_down_sum_##NAME(ExpertDownSumParams p) { expert_down_sum_f32<ROWS>(p); }
EXPERT_PRODUCTS(f32, FloatRows<TY_F32>)
EXPERT_PRODUCTS(f16, FloatRows<TY_F16>)
EXPERT_PRODUCTS(bf16, FloatRows<TY_BF16>)
EXPERT_PRODUCTS(fp8, FloatRows<TY_FP8>)
EXPERT_PRODUCTS(q8_0, QuantRows<TY_Q8_0>)
EXPERT_PRODUCTS(q4_0, QuantRows<TY_Q4_0>)
EXPERT_PRODUCTS(q4_1, QuantRows<TY_Q4_1>)
EXPERT_PRODUCTS(q5_0, QuantRows<TY_Q5_0>)
EXPERT_PRODUCTS(q4_k, QuantRows<TY_Q4_K>)
EXPERT_PRODUCTS(q6_k, QuantRows<TY_Q6_K>)

// expert_down_sum on the hidden rows quantized to int8 (pair i's at row i of xq and xd), a warp
// taking RowsPerWarp rows of its pick's expert (Q4_K: two). Held to three blocks a multiprocessor
// (80 registers): a step's one token has only k x n_out rows, and more blocks resident take them
// in fewer rounds of memory latency.
template <int TY>
__device__ __forceinline__ void expert_down_sum_int(const ExpertDownSumParams& p) {
    expert_down_sum<RowsPerWarp<TY, 1>::value>(p, [&](const Weight& w, int row, int n_rows, u64 pair, float* part) {
        int_row<TY, 1, false>(w, w, row, n_rows, p.xq + pair * p.n_in, int_scales<TY>(p.xd, pair, p.n_in), part,
                              [] {}, false);
    });
}

// Q4_K's down products of narrow experts (rows of at most Q4K_NARROW_IN values, one stage of 16
// groups): a warp takes four rows, so that twice the bytes are in flight a warp and half the
// blocks are launched, where two rows of 768 values left a token's few rounds of blocks each
// waiting on little memory.
#define Q4K_NARROW_IN 1024
__device__ __forceinline__ void expert_down_sum_narrow_q4_k(const ExpertDownSumParams& p) {
    expert_down_sum<4>(p, [&](const Weight& w, int row, int n_rows, u64 pair, float* part) {
        kquant_rows<TY_Q4_K, 1, 4, false>(w, w, row, n_rows, p.xq + pair * p.n_in,
                                          int_scales<TY_Q4_K>(p.xd, pair, p.n_in), part, [] {}, false);
    });
}
extern "C" __global__ void __launch_bounds__(256, 3) expert_down_sum_int_narrow_q4_k(ExpertDownSumParams p) {
    expert_down_sum_narrow_q4_k(p);
}

#define EXPERT_PRODUCTS_INT(NAME, TY)                                                                                 \
    extern "C" __global__ void expert_rows_int_glu_##NAME(ExpertProductParams p) { expert_rows_int_glu<TY>(p); }     \
    extern "C" __global__ void __launch_bounds__(256, 3) expert_down_sum_int_##NAME(ExpertDownSumParams p) {         \
        expert_down_sum_int<TY>(p);                                                                                    \
    }
EXPERT_PRODUCTS_INT(q8_0, TY_Q8_0)
EXPERT_PRODUCTS_INT(q4_0, TY_Q4_0)
EXPERT_PRODUCTS_INT(q4_1, TY_Q4_1)
EXPERT_PRODUCTS_INT(q5_0, TY_Q5_0)
EXPERT_PRODUCTS_INT(q4_k, TY_Q4_K)
EXPERT_PRODUCTS_INT(q6_k, TY_Q6_K)

// The (token, expert) pairs grouped by expert, each expert's in pair order: offsets[e] is expert
// e's first slot (offsets[n_experts] the pairs placed), slots[i] pair i's slot and pairs[s] slot
// s's pair. Three launches, no atomics, so the grouping is the same every run: each warp counts
// its chunk of GROUP_CHUNK pairs by expert (`counts`, a row of n_experts a chunk), one block turns
// the counts into each expert's first slot and each chunk's first slot within its experts' groups,
// and each warp places its chunk's pairs from there. Pairs whose id is outside the set are placed
// nowhere (experts_sum makes their rows NaN). A warp's counters per expert are in shared memory.
#define GROUP_CHUNK 512
#define GROUP_WARPS 4

// Walks chunk `chunk` 32 pairs at a time, in order: lanes of one expert find each other by
// __match_any_sync, take slots next[e] + (their rank among them), and the lowest moves next[e]
// on. With PLACE the slots are written.
template <bool PLACE> __device__ __forceinline__ void walk_chunk(const GroupPairsParams& p, u32 chunk, u32* next) {
    int lane = threadIdx.x % 32;
    u32 first = chunk * GROUP_CHUNK, end = min(first + GROUP_CHUNK, (u32)p.n_pairs);
    for (u32 at = first; at < end; at += 32) {
        u32 i = at + lane, e = i < end ? p.ids[i] : 0xffffffffu;
        bool placed = e < (u32)p.n_experts;
        u32 peers = __match_any_sync(0xffffffffu, e), rank = __popc(peers & ((1u << lane) - 1));
        if (PLACE && placed) {
            u32 s = next[e] + rank;
            p.slots[i] = s;
            p.pairs[s] = i;
        }
        __syncwarp();
        if (placed && rank == 0) next[e] += __popc(peers);
        __syncwarp();
    }
}

extern "C" __global__ void group_pairs_count(GroupPairsParams p) {
    extern __shared__ u32 group_next[];
    begin_after_inputs();
    int lane = threadIdx.x % 32, n = p.n_experts;
    u32 chunk = blockIdx.x * GROUP_WARPS + threadIdx.x / 32, *next = group_next + (threadIdx.x / 32) * n;
    if (chunk * GROUP_CHUNK >= (u32)p.n_pairs) return;
    for (int e = lane; e < n; e += 32) next[e] = 0;
    __syncwarp();
    walk_chunk<false>(p, chunk, next);
    for (int e = lane; e < n; e += 32) p.counts[(u64)chunk * n + e] = next[e];
}

// One block: each expert's counts become the first slot of each chunk's pairs within the expert's
// group (a thread an expert, over the chunks in order), then warp 0 sums the groups' sizes into
// the offsets, 32 experts at a time.
extern "C" __global__ void group_pairs_scan(GroupPairsParams p) {
    extern __shared__ u32 group_sizes[];
    begin_after_inputs();
    int n = p.n_experts, lane = threadIdx.x % 32;
    u32 chunks = (p.n_pairs + GROUP_CHUNK - 1) / GROUP_CHUNK;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        u32 size = 0;
        for (u32 c = 0; c < chunks; c++) {
            u32 count = p.counts[(u64)c * n + e];
            p.counts[(u64)c * n + e] = size;
            size += count;
        }
        group_sizes[e] = size;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    if (lane == 0) p.offsets[0] = 0;
    u32 before = 0;
    for (int base = 0; base < n; base += 32) {
        u32 through = base + lane < n ? group_sizes[base + lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            u32 v = __shfl_up_sync(0xffffffffu, through, o);
            if (lane >= o) through += v;
        }
        if (base + lane < n) p.offsets[base + lane + 1] = before + through;
        before += __shfl_sync(0xffffffffu, through, 31);
    }
}

extern "C" __global__ void group_pairs_place(GroupPairsParams p) {
    extern __shared__ u32 group_next[];
    begin_after_inputs();
    int lane = threadIdx.x % 32, n = p.n_experts;
    u32 chunk = blockIdx.x * GROUP_WARPS + threadIdx.x / 32, *next = group_next + (threadIdx.x / 32) * n;
    if (chunk * GROUP_CHUNK >= (u32)p.n_pairs) return;
    for (int e = lane; e < n; e += 32) next[e] = p.offsets[e] + p.counts[(u64)chunk * n + e];
    __syncwarp();
    walk_chunk<true>(p, chunk, next);
}

// Each placed slot's input row, its pair's token's row of x: four values a thread, as they are
// (row_type TY_F32) or in the 16 bits (TY_F16, TY_BF16) that the tensor cores' products take.
extern "C" __global__ void gather_pairs(GatherPairsParams p) {
    begin_after_inputs();
    u64 per_row = p.dim / 4, placed = p.offsets[p.n_experts];
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < placed * per_row; i += (u64)gridDim.x * blockDim.x) {
        u64 slot = i / per_row;
        float4 v = p.x[p.pairs[slot] / p.k * per_row + i % per_row];
        if (p.row_type == TY_F32)
            ((float4*)p.rows)[i] = v;
        else
            ((uint2*)p.rows)[i] = pack_16bit4(v, p.row_type);
    }
}

// residual[t] += sum_j weights[t, j] * out[slot of pair (t, j)], the pairs in pick order as the CPU
// adds them, one thread a value: no atomics, so the sum is the same every run. NaN where an id is
// outside the set.
extern "C" __global__ void experts_sum(ExpertsSumParams p) {
    begin_after_inputs();
    int k = p.k, dim = p.dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / dim, c = i % dim;
        float acc = p.residual[i];
        bool bad = false;
        for (int j = 0; j < k; j++) {
            u64 pair = t * k + j;
            if (p.ids[pair] >= (u32)p.n_experts) {
                bad = true;
                continue;
            }
            u64 slot = p.slots ? p.slots[pair] : pair;
            acc += p.weights[pair] * p.out[slot * dim + c];
        }
        p.residual[i] = bad ? __int_as_float(0x7fc00000u) : acc;
    }
}

// x[t] += sigmoid(gates[t]) * rows[t] for rows of `width` (Qwen2-MoE's gated shared expert).
extern "C" __global__ void add_gated(AddGatedParams p) {
    begin_after_inputs();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
        float gate = 1.0f / (1.0f + expf(-p.gates[i / p.width]));
        p.x[i] += gate * p.rows[i];
    }
}
