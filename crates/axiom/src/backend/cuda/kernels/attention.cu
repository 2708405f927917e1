// Causal grouped-query attention over the paged KV cache (f16 or f32), for decode and short steps.
// Grid: (tokens, heads, splits), ATTN_THREADS threads; query head h reads KV head h / (n_heads /
// n_kv_heads); head_dim a multiple of 8, up to 256. Token t sees the positions of its window
// (Scores), lo..=positions[t]: the last `window` of them, or all from 0 where window is 0; its
// scores are scale * q.k, capped to softcap * tanh(s / softcap) where softcap is not 0.
//
// A head's dimensions are cut into chunks of 8, and a group of `lanes` neighbouring lanes (the
// chunk count rounded up to a power of two) holds one chunk each of the query, of a position's
// key and value rows, and of the group's weighted sum. The groups share out the context
// lo..=positions[t] position by position, each keeping its own online softmax, so the loop has no
// barrier: a group loads the key and the value rows of ATTN_BATCH positions at once (one 16-byte
// load each for f16), finishes the scores with shuffles inside the group, and folds the batch into
// its running maximum, sum and weighted values. The groups meet only at the end, through shuffles
// inside each warp and shared memory across warps. A decode step is thus a few memory round trips
// whatever its context.
//
// Each pass of the groups over ATTN_BATCH * groups positions after the first costs about as much
// as the whole kernel at a short context. So where a step has few heads (decode: the 8B's 32
// against the H200's 132 multiprocessors), several blocks share a head's context (`splits`, the
// grid's third dimension): split s takes passes s, s + splits, ..., so that a context of up to
// `splits` passes is read in one, before the wait, and the splits without a pass leave at once.
// The others post their softmax states to split 0, which combines them.
//
// In a step of one token, attention may also take the token's own key and value rows as the
// products wrote them (`NewToken`): it then rotates the query and the key itself (RoPE), uses
// them from shared memory for the token's own position, and one block of each KV head's group
// stores the token's cache row, so that no rope_kv_write runs before it.
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / 32)
#define ATTN_BATCH 4
// The most blocks that share a head's context.
#define ATTN_MAX_SPLITS 8

// 8 values of a cache row as loaded, one 16-byte load (f16) or two (f32), and as floats.
template <typename T>
struct Raw8;
template <>
struct Raw8<u16> {
    uint4 a;
};
template <>
struct Raw8<float> {
    float4 a, b;
};

__device__ __forceinline__ Raw8<u16> load_raw8(const u16* p) { return {__ldg((const uint4*)p)}; }
__device__ __forceinline__ Raw8<float> load_raw8(const float* p) {
    return {__ldg((const float4*)p), __ldg((const float4*)p + 1)};
}

// The inverse of widen8: 8 values as a cache row holds them (they are already of the cache's type).
__device__ __forceinline__ void narrow8(const float* v, Raw8<u16>& raw) {
    u32 w[4];
    for (int j = 0; j < 4; j++) w[j] = (u32)f32_to_f16(v[2 * j]) | (u32)f32_to_f16(v[2 * j + 1]) << 16;
    raw.a = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void narrow8(const float* v, Raw8<float>& raw) {
    raw.a = make_float4(v[0], v[1], v[2], v[3]);
    raw.b = make_float4(v[4], v[5], v[6], v[7]);
}

// A value as the cache stores it.
__device__ __forceinline__ float cached_value(float v, const u16*) { return f16_to_f32(f32_to_f16(v)); }
__device__ __forceinline__ float cached_value(float v, const float*) { return v; }

__device__ __forceinline__ void widen8(Raw8<u16> raw, float* v) {
    u32 w[4] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w};
    for (int j = 0; j < 4; j++) {
        v[2 * j] = f16_to_f32((u16)(w[j] & 0xffff));
        v[2 * j + 1] = f16_to_f32((u16)(w[j] >> 16));
    }
}

__device__ __forceinline__ void widen8(Raw8<float> raw, float* v) {
    float4 a = raw.a, b = raw.b;
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// exp(m - m_new), or 0 where m is -inf (a masked score, or a softmax that has seen no position
// yet), even if m_new is -inf too.
__device__ __forceinline__ float rescale(float m, float m_new) {
    return m == __int_as_float(0xff800000u) ? 0.0f : expf(m - m_new);
}

// One online softmax state: running maximum m, sum l, and this lane's 8 dimensions of the
// weighted values. `merge` folds in the state held `offset` lanes away.
struct Softmax {
    float m, l, acc[8];

    __device__ __forceinline__ void merge(int offset) {
        float m_other = __shfl_xor_sync(0xffffffffu, m, offset);
        float m_new = fmaxf(m, m_other);
        float mine = rescale(m, m_new), other = rescale(m_other, m_new);
        l = l * mine + __shfl_xor_sync(0xffffffffu, l, offset) * other;
        for (int j = 0; j < 8; j++) acc[j] = acc[j] * mine + __shfl_xor_sync(0xffffffffu, acc[j], offset) * other;
        m = m_new;
    }
};

// A float posted to another block with its flag (see the end of `attention`), through L2.
#define POSTED (1ull << 32)
__device__ __forceinline__ void post(u64* slot, float v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(slot), "l"(POSTED | __float_as_uint(v)) : "memory");
}
__device__ __forceinline__ void clear(u64* slot) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(slot), "l"(0ull) : "memory");
}
__device__ __forceinline__ u64 peek(const u64* slot) {
    u64 x;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(x) : "l"(slot) : "memory");
    return x;
}
__device__ __forceinline__ float posted_value(u64 x) { return __uint_as_float((u32)x); }

// Softmax states 0..n-1 (n at most N), with maxima m[i] and sums l[i], as one for a dimension whose
// weighted value in state i is value(i): the common maximum, the sum and the weighted value scaled
// to it. (Unrolled to N, so that value(i) may index registers.)
template <int N, typename Value>
__device__ __forceinline__ float3 merged(const float* m, const float* l, int n, Value value) {
    float top = m[0];
#pragma unroll
    for (int i = 1; i < N; i++)
        if (i < n) top = fmaxf(top, m[i]);
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int i = 0; i < N; i++)
        if (i < n) {
            float weight = rescale(m[i], top);
            sum += l[i] * weight;
            o += value(i) * weight;
        }
    return make_float3(top, sum, o);
}

// The one token's key and value rows (f32, before RoPE), and the rotation: pairs by `halves` (as
// rope_kv_write) over the first `dims` dimensions by position * freqs[i], cosine and sine times
// `scale`. k null: the cache already holds the token's row (rope_kv_write ran).
struct NewToken {
    const float* k;
    const float* v;
    const float* freqs;
    int dims, halves;
    float scale;
};

// How a token weighs the positions it sees (AttentionParams).
struct ScoreRule {
    float scale, softcap;
    int window;
};

template <typename T>
__device__ void attention(const float* __restrict__ q, T* __restrict__ k_cache, T* __restrict__ v_cache,
                          const u32* __restrict__ positions, const u32* __restrict__ tables, int table_width,
                          const u32* __restrict__ token_seqs, int page_size, NewToken fresh, float* __restrict__ out,
                          i8* xq, float* xd, int interleave, int start_next, u64* partials,
                          int n_heads, int n_kv_heads, int head_dim, ScoreRule rule) {
    __shared__ float warp_m[ATTN_WARPS], warp_l[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][256];
    __shared__ double2 turns[ROPE_MAX_PAIRS];
    __shared__ __align__(16) float own_q[256], own_k[256], own_v[256];
    int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int chunks = head_dim / 8, lanes = 1;
    while (lanes < chunks) lanes *= 2;
    int groups_per_warp = 32 / lanes, n_groups = ATTN_WARPS * groups_per_warp;
    int group = warp * groups_per_warp + lane / lanes, c = lane % lanes;
    bool in_head = c < chunks;  // lanes past the head's last chunk only take part in the shuffles
    int group_size = n_heads / n_kv_heads;
    u64 kv_width = (u64)n_kv_heads * head_dim, kv_head = (u64)(h / group_size) * head_dim, kv_off = kv_head + 8 * c;
    // The token sees positions lo..n_ctx-1; the passes start at lo.
    int n_ctx = __ldg(positions + t) + 1, lo = rule.window > 0 ? max(0, n_ctx - rule.window) : 0;
    int pass = ATTN_BATCH * n_groups, first = lo + split * pass;
    int active = min(splits, (n_ctx - lo + pass - 1) / pass);  // the splits with a pass
    if (split >= active) return;
    const u32* table = tables + (u64)__ldg(token_seqs + t) * table_width;
    bool rotates = fresh.k != nullptr;
    auto load = [&](int p, Raw8<T>& k, Raw8<T>& v) {
        if (rotates && p == n_ctx - 1) {  // the token's own row, rotated below
            narrow8(own_k + 8 * c, k);
            narrow8(own_v + 8 * c, v);
            return;
        }
        u64 row = page_row<true>(table, page_size, p) * kv_width + kv_off;
        k = load_raw8(k_cache + row);
        v = load_raw8(v_cache + row);
    };
    // In a step of one token only its own row of the cache is written by the step (by
    // rope_kv_write before this kernel, or by this one, which then never reads it back from
    // memory): the rows before it, written by earlier steps, are loaded before the wait, the first
    // batch of them, so that their trip overlaps the kernel before.
    bool early = gridDim.x == 1;
    auto loaded_early = [&](int base, int p) { return early && base == first && p < n_ctx - 1; };
    Raw8<T> k_raw[ATTN_BATCH], v_raw[ATTN_BATCH];
    for (int b = 0; b < ATTN_BATCH; b++) {
        int p = first + b * n_groups + group;
        if (in_head && loaded_early(first, p)) load(p, k_raw[b], v_raw[b]);
    }
    // The angles and the token's cache row come from the frequencies, the positions and the block
    // tables: all found before the wait (common.cuh). (RoPE here instead of in rope_kv_write saves
    // that kernel's launch and the rows' trip through memory.)
    int half = fresh.dims / 2;
    u64 own_row = 0;
    if (rotates) {
        for (int i = threadIdx.x; i < half; i += ATTN_THREADS)
            turns[i] = turn(n_ctx - 1, fresh.freqs, i, fresh.scale);
        own_row = page_row<true>(table, page_size, n_ctx - 1) * kv_width + kv_head;
    }
    begin_after_inputs();
    if (start_next) start_dependents();

    if (rotates) {
        const float* qh = q + ((u64)t * n_heads + h) * head_dim;
        const float* kh = fresh.k + (u64)t * kv_width + kv_head;
        const float* vh = fresh.v + (u64)t * kv_width + kv_head;
        for (int d = threadIdx.x; d < head_dim; d += ATTN_THREADS) {
            own_q[d] = qh[d];
            own_k[d] = d < fresh.dims ? kh[d] : cached_value(kh[d], k_cache);
            own_v[d] = cached_value(vh[d], v_cache);
        }
        __syncthreads();
        // The query's pairs, then the key's, each rotated by one thread; the key as the cache
        // holds it, so that this position weighs the same as when later steps read it back.
        for (int p = threadIdx.x; p < 2 * half; p += ATTN_THREADS) {
            bool key = p >= half;
            int i = p % half, a = fresh.halves ? i : 2 * i, b = fresh.halves ? i + half : 2 * i + 1;
            float* head = key ? own_k : own_q;
            float2 x = rotated(head[a], head[b], turns[i]);
            head[a] = key ? cached_value(x.x, k_cache) : x.x;
            head[b] = key ? cached_value(x.y, k_cache) : x.y;
        }
        __syncthreads();
        // The first query head of each KV head's group stores the token's row.
        if (h % group_size == 0 && split == 0)
            for (int d = threadIdx.x; d < head_dim; d += ATTN_THREADS) {
                put(k_cache + own_row + d, own_k[d]);
                put(v_cache + own_row + d, own_v[d]);
            }
    }

    float qc[8] = {};
    if (in_head) {
        const float* qh = (rotates ? own_q : q + ((u64)t * n_heads + h) * head_dim) + 8 * c;
        float scale = rule.scale;
        float4 a = *(const float4*)qh, b = *((const float4*)qh + 1);
        qc[0] = a.x * scale, qc[1] = a.y * scale, qc[2] = a.z * scale, qc[3] = a.w * scale;
        qc[4] = b.x * scale, qc[5] = b.y * scale, qc[6] = b.z * scale, qc[7] = b.w * scale;
    }

    Softmax sm = {__int_as_float(0xff800000u), 0.0f, {}};
    // Every lane runs the same number of batches, so that the shuffles inside meet; a batch's
    // position b of this group is base + b * n_groups + group.
    for (int base = first; base < n_ctx; base += splits * pass) {
        for (int b = 0; b < ATTN_BATCH; b++) {
            int p = base + b * n_groups + group;
            if (in_head && p < n_ctx && !loaded_early(base, p)) load(p, k_raw[b], v_raw[b]);
        }
        float s[ATTN_BATCH], m_new = sm.m;
        for (int b = 0; b < ATTN_BATCH; b++) {
            float k[8], dot = 0.0f;
            if (in_head) {
                widen8(k_raw[b], k);
                for (int j = 0; j < 8; j++) dot += qc[j] * k[j];
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                if (o < lanes) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (rule.softcap != 0.0f) dot = rule.softcap * tanhf(dot / rule.softcap);
            s[b] = base + b * n_groups + group < n_ctx ? dot : __int_as_float(0xff800000u);
            m_new = fmaxf(m_new, s[b]);
        }
        float correction = rescale(sm.m, m_new);
        sm.l *= correction;
        for (int j = 0; j < 8; j++) sm.acc[j] *= correction;
        for (int b = 0; b < ATTN_BATCH; b++) {
            float p = rescale(s[b], m_new), v[8];
            sm.l += p;
            if (in_head && p > 0.0f) {
                widen8(v_raw[b], v);
                for (int j = 0; j < 8; j++) sm.acc[j] += p * v[j];
            }
        }
        sm.m = m_new;
    }

    // The groups of a warp meet by shuffles, then the warps in shared memory.
    for (int o = lanes; o < 32; o *= 2) sm.merge(o);
    if (lane < lanes) {
        if (in_head)
            for (int j = 0; j < 8; j++) warp_acc[warp][8 * c + j] = sm.acc[j];
        if (lane == 0) warp_m[warp] = sm.m, warp_l[warp] = sm.l;
    }
    __syncthreads();
    auto emit = [&](int d, float v) {
        u64 i = ((u64)t * n_heads + h) * head_dim + d;
        out[i] = v;
        // Quantized for an integer output projection, with no launch of its own: a warp holds
        // one block of 32 (head_dim is then a multiple of 32).
        if (xq) {
            int n_in = n_heads * head_dim;
            store_q8(v, xq, xd, i, (u64)t * n_in + q8_slot(h * head_dim + d, n_in, interleave), interleave);
        }
    };
    // A thread has at most one dimension of the output (ATTN_THREADS >= the largest head).
    int d = threadIdx.x;
    float3 own = merged<ATTN_WARPS>(warp_m, warp_l, ATTN_WARPS, [&](int w) { return warp_acc[w][d]; });
    if (active == 1) {
        if (d < head_dim) emit(d, own.z / own.y);
        return;
    }
    // Split 0 combines the other splits' states. Each of their threads posts its value with a
    // flag in the same 8-byte store, so that a reader that sees the flag sees the value: no fence.
    // Split 0 takes them as they arrive and clears them for the next launch (every split is
    // running or done by the time it waits: no split waits for anything else).
    u64* slots = partials + ((u64)t * n_heads + h) * splits * (head_dim + 2);
    if (split > 0) {
        u64* mine = slots + split * (head_dim + 2);
        if (d < head_dim) post(mine + d, own.z);
        if (d == 0) post(mine + head_dim, own.x), post(mine + head_dim + 1, own.y);
        return;
    }
    // Thread i (0 < i < active) takes split i's maximum and sum, every thread its dimension of
    // each split's weighted values.
    __shared__ float split_m[ATTN_MAX_SPLITS], split_l[ATTN_MAX_SPLITS];
    bool takes_sums = d > 0 && d < active;
    u64 *sums = slots + d * (head_dim + 2) + head_dim, acc[ATTN_MAX_SPLITS], m = 0, l = 0;
    bool waiting;
    do {
        waiting = false;
#pragma unroll
        for (int i = 1; i < ATTN_MAX_SPLITS; i++)
            if (i < active && d < head_dim) {
                acc[i] = peek(slots + i * (head_dim + 2) + d);
                waiting |= !(acc[i] & POSTED);
            }
        if (takes_sums) {
            m = peek(sums), l = peek(sums + 1);
            waiting |= !(m & l & POSTED);
        }
    } while (waiting);
    if (d == 0) split_m[0] = own.x, split_l[0] = own.y;
    if (takes_sums) {
        split_m[d] = posted_value(m), split_l[d] = posted_value(l);
        clear(sums), clear(sums + 1);
    }
    __syncthreads();
    if (d >= head_dim) return;
    float3 all = merged<ATTN_MAX_SPLITS>(split_m, split_l, active,
                                         [&](int i) { return i == 0 ? own.z : posted_value(acc[i]); });
    emit(d, all.z / all.y);
#pragma unroll
    for (int i = 1; i < ATTN_MAX_SPLITS; i++)
        if (i < active) clear(slots + i * (head_dim + 2) + d);
}

#define ATTENTION(NAME, T)                                                                                        \
    extern "C" __global__ void attention_##NAME(AttentionParams p) {                                             \
        attention(p.q, (T*)p.k_cache, (T*)p.v_cache, p.positions, p.tables, p.table_width, p.token_seqs,           \
                  p.page_size, NewToken{p.k_new, p.v_new, p.freqs, p.dims, p.halves, p.rope_scale}, p.out, p.xq, p.xd,           \
                  p.interleave, p.start_next, p.partials, p.n_heads, p.n_kv_heads, p.head_dim,                    \
                  ScoreRule{p.scale, p.softcap, p.window});                                                      \
    }
ATTENTION(f16, u16)
ATTENTION(f32, float)
