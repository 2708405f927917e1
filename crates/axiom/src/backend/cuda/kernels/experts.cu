// Mixture-of-experts ops (cuda/experts.rs). `route` leaves each token's chosen experts on the
// device and every kernel after it reads them there: no trip to the host between the router and
// the experts, so a decode step's graph holds the whole block.

// Each token's k experts from its router logits, as cpu/kernels/route.rs chooses them: a softmax
// over the n_experts, the k most probable, the lowest index first among equals, their
// probabilities divided by their sum with `renormalize`. One warp a token, eight a block. Pick j is
// the best expert ranked after pick j - 1 (probability descending, then index ascending), so
// nothing needs marking as taken.
__device__ __forceinline__ int warp_min(int v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void route(RouteParams p) {
    begin_after_inputs();
    int lane = threadIdx.x % 32, token = blockIdx.x * 8 + threadIdx.x / 32;
    if (token >= p.n_tokens) return;
    int n = p.n_experts, k = p.k;
    const float* row = p.logits + (u64)token * n;
    float top = __int_as_float(0xff800000u);
    for (int e = lane; e < n; e += 32) top = fmaxf(top, row[e]);
    top = warp_max(top);
    float sum = 0.0f;
    for (int e = lane; e < n; e += 32) sum += expf(row[e] - top);
    sum = warp_sum(sum);
    u32* ids = p.ids + (u64)token * k;
    float* weights = p.weights + (u64)token * k;
    float last_p = __int_as_float(0x7f800000u);
    int last_e = -1;
    for (int j = 0; j < k; j++) {
        // A lane's best among its experts (ascending, so the lowest index among its equals), then
        // the warp's: the highest probability, the lowest index holding it.
        float best_p = -1.0f;
        int best_e = n;
        for (int e = lane; e < n; e += 32) {
            float prob = expf(row[e] - top) / sum;
            bool after = prob < last_p || (prob == last_p && e > last_e);
            if (after && prob > best_p) best_p = prob, best_e = e;
        }
        last_p = warp_max(best_p);
        last_e = warp_min(best_p == last_p ? best_e : n);
        if (lane == 0) ids[j] = (u32)last_e, weights[j] = last_p;
    }
    // Summed in pick order by one lane, as the CPU sums them.
    if (p.renormalize && lane == 0) {
        float chosen = 0.0f;
        for (int j = 0; j < k; j++) chosen += weights[j];
        for (int j = 0; j < k; j++) weights[j] /= chosen;
    }
}

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

#define EXPERT_PRODUCTS(NAME, ROWS)                                                                                    \
    extern "C" __global__ void expert_rows_##NAME(ExpertProductParams p) { expert_rows<ROWS, false>(p); }             \
    extern "C" __global__ void expert_rows_glu_##NAME(ExpertProductParams p) { expert_rows<ROWS, true>(p); }          \
    extern "C" __global__ void expert_groups_##NAME(ExpertProductParams p) { expert_groups<ROWS, false>(p); }         \
    extern "C" __global__ void expert_groups_glu_##NAME(ExpertProductParams p) { expert_groups<ROWS, true>(p); }
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

// The (token, expert) pairs grouped by expert, each expert's in pair order: offsets[e] is expert
// e's first slot (offsets[n_experts] the pairs placed), slots[i] pair i's slot and pairs[s] slot
// s's pair. One block: warp w takes experts w, w + 32, ..., counting then placing their pairs by
// ballots over the ids, so the grouping is the same every run (no atomics). Pairs whose id is
// outside the set are placed nowhere (experts_sum makes their rows NaN).
extern "C" __global__ void group_pairs(GroupPairsParams p) {
    begin_after_inputs();
    int lane = threadIdx.x % 32, warps = blockDim.x / 32, n = p.n_pairs;
    auto matches = [&](int first, u32 e) {
        bool hit = first + lane < n && __ldg(p.ids + first + lane) == e;
        return __ballot_sync(0xffffffffu, hit);
    };
    for (u32 e = threadIdx.x / 32; e < (u32)p.n_experts; e += warps) {
        u32 count = 0;
        for (int first = 0; first < n; first += 32) count += __popc(matches(first, e));
        if (lane == 0) p.offsets[e + 1] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        p.offsets[0] = 0;
        for (int e = 0; e < p.n_experts; e++) p.offsets[e + 1] += p.offsets[e];
    }
    __syncthreads();
    for (u32 e = threadIdx.x / 32; e < (u32)p.n_experts; e += warps) {
        u32 slot = p.offsets[e];
        for (int first = 0; first < n; first += 32) {
            u32 hits = matches(first, e);
            if (hits >> lane & 1) {
                u32 s = slot + __popc(hits & ((1u << lane) - 1));
                p.slots[first + lane] = s;
                p.pairs[s] = first + lane;
            }
            slot += __popc(hits);
        }
    }
}

// Each placed slot's input row, its pair's token's row of x: four values a thread.
extern "C" __global__ void gather_pairs(GatherPairsParams p) {
    begin_after_inputs();
    u64 per_row = p.dim / 4, placed = p.offsets[p.n_experts];
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < placed * per_row; i += (u64)gridDim.x * blockDim.x) {
        u64 slot = i / per_row;
        p.rows[i] = p.x[p.pairs[slot] / p.k * per_row + i % per_row];
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
