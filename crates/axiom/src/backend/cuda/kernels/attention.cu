// Causal grouped-query attention over the paged KV cache (f16 or f32), for decode and short steps.
// Grid: (tokens, heads), ATTN_THREADS threads; query head h reads KV head h / (n_heads /
// n_kv_heads); head_dim a multiple of 8, up to 256. The context 0..=positions[t] of the token's
// sequence goes through in tiles of ATTN_THREADS positions, with an online softmax from tile to
// tile. In a tile, each thread scores one position (its key row against the query, which sits in
// shared memory), so the loads of a whole tile go out at once; the block takes the tile's maximum
// and sum; then each thread weights 8 dimensions of the value rows of every groups-th position
// (16- or 32-byte loads), and the groups' sums meet in shared memory at the end. A decode step is
// thus a handful of memory round trips whatever its context.
#define ATTN_THREADS 256
#define MAX_HEAD_DIM 256

// 8 values of a cache row, from one 16-byte load (f16) or two (f32).
__device__ __forceinline__ void load8(const u16* p, float* v) {
    uint4 raw = __ldg((const uint4*)p);
    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int j = 0; j < 4; j++) {
        v[2 * j] = f16_to_f32((u16)(w[j] & 0xffff));
        v[2 * j + 1] = f16_to_f32((u16)(w[j] >> 16));
    }
}

__device__ __forceinline__ void load8(const float* p, float* v) {
    float4 a = __ldg((const float4*)p), b = __ldg((const float4*)p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The maximum (MAX) or sum of v over the block; `scratch` holds 32 floats.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    v = MAX ? warp_max(v) : warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < blockDim.x / 32; w++) r = MAX ? fmaxf(r, scratch[w]) : r + scratch[w];
    __syncthreads();  // scratch is free again
    return r;
}

template <typename T>
__device__ void attention(const float* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                          const u32* __restrict__ positions, const u32* __restrict__ tables, int table_width,
                          const u32* __restrict__ token_seqs, int page_size, float* __restrict__ out, int n_heads,
                          int n_kv_heads, int head_dim) {
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float probs[ATTN_THREADS];
    __shared__ u64 rows[ATTN_THREADS];  // the tile's cache rows
    __shared__ float partial[ATTN_THREADS * 8];
    __shared__ float scratch[32];
    begin_after_inputs();
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    u64 kv_width = (u64)n_kv_heads * head_dim, kv_off = (u64)(h / (n_heads / n_kv_heads)) * head_dim;
    const float* qh = q + ((u64)t * n_heads + h) * head_dim;
    float scale = rsqrtf((float)head_dim);
    for (int d = tid; d < head_dim; d += ATTN_THREADS) qs[d] = qh[d] * scale;
    int n_ctx = positions[t] + 1;
    const u32* table = tables + (u64)token_seqs[t] * table_width;
    int chunks = head_dim / 8, groups = ATTN_THREADS / chunks, group = tid / chunks, c = tid % chunks;
    float m = __int_as_float(0xff800000u), l = 0.0f, acc[8] = {};
    __syncthreads();  // qs is complete
    for (int base = 0; base < n_ctx; base += ATTN_THREADS) {
        int len = min(ATTN_THREADS, n_ctx - base);
        float s = __int_as_float(0xff800000u);
        if (tid < len) {
            u64 row = page_row(table, page_size, base + tid);
            rows[tid] = row;
            const T* k = k_cache + row * kv_width + kv_off;
            s = 0.0f;
#pragma unroll 8
            for (int d = 0; d < head_dim; d += 8) {
                float kv[8];
                load8(k + d, kv);
                for (int j = 0; j < 8; j++) s += qs[d + j] * kv[j];
            }
        }
        float m_new = fmaxf(m, block_reduce<true>(s, scratch));  // (also publishes rows)
        float p = tid < len ? expf(s - m_new) : 0.0f;
        probs[tid] = p;
        float correction = expf(m - m_new);
        l = l * correction + block_reduce<false>(p, scratch);  // (also publishes probs)
        for (int j = 0; j < 8; j++) acc[j] *= correction;
        if (group < groups) {
#pragma unroll 4
            for (int i = group; i < len; i += groups) {
                float v[8];
                load8(v_cache + rows[i] * kv_width + kv_off + 8 * c, v);
                for (int j = 0; j < 8; j++) acc[j] += probs[i] * v[j];
            }
        }
        m = m_new;
        __syncthreads();  // the next tile rewrites rows and probs
    }
    if (group < groups)
        for (int j = 0; j < 8; j++) partial[group * head_dim + 8 * c + j] = acc[j];
    __syncthreads();
    if (tid < head_dim) {
        float o = 0.0f;
        for (int g = 0; g < groups; g++) o += partial[g * head_dim + tid];
        out[((u64)t * n_heads + h) * head_dim + tid] = o / l;
    }
}

extern "C" __global__ void attention_f16(const float* q, const u16* k, const u16* v, const u32* pos, const u32* tables,
                                         int table_width, const u32* token_seqs, int page_size, float* out,
                                         int n_heads, int n_kv_heads, int head_dim) {
    attention(q, k, v, pos, tables, table_width, token_seqs, page_size, out, n_heads, n_kv_heads, head_dim);
}
extern "C" __global__ void attention_f32(const float* q, const float* k, const float* v, const u32* pos,
                                         const u32* tables, int table_width, const u32* token_seqs, int page_size,
                                         float* out, int n_heads, int n_kv_heads, int head_dim) {
    attention(q, k, v, pos, tables, table_width, token_seqs, page_size, out, n_heads, n_kv_heads, head_dim);
}
