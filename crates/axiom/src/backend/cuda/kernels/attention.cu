// Causal grouped-query attention over the paged KV cache (f16 or f32), one pass with an online
// softmax. Grid: (tokens, heads); 4 warps per block take the positions 0..=positions[t] of the
// token's sequence in turn, each
// lane holding head dimensions lane, lane + 32, ...; the warps' partial results are merged at
// the end. Query head h reads KV head h / (n_heads / n_kv_heads).
#define ATTN_WARPS 4
#define MAX_PER_LANE 8  // head_dim up to 256

__device__ __forceinline__ float get(const u16* p) { return f16_to_f32(*p); }
__device__ __forceinline__ float get(const float* p) { return *p; }

template <typename T>
__device__ void attention(const float* q, const T* k_cache, const T* v_cache, const u32* positions,
                          const u32* tables, int table_width, const u32* token_seqs, int page_size, float* out,
                          int n_heads, int n_kv_heads, int head_dim) {
    int t = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int kv_width = n_kv_heads * head_dim;
    int kv_off = (h / (n_heads / n_kv_heads)) * head_dim;
    const float* qh = q + ((u64)t * n_heads + h) * head_dim;
    float scale = rsqrtf((float)head_dim);
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
    for (int k = 0; k < MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        qv[k] = d < head_dim ? qh[d] * scale : 0.0f;
        acc[k] = 0.0f;
    }
    float m = __int_as_float(0xff800000u), l = 0.0f;
    int n_ctx = positions[t] + 1;
    const u32* table = tables + (u64)token_seqs[t] * table_width;
    for (int p = warp; p < n_ctx; p += ATTN_WARPS) {
        u64 row = page_row(table, page_size, p);
        const T* kr = k_cache + row * kv_width + kv_off;
        float s = 0.0f;
        for (int k = 0; k < MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (d < head_dim) s += qv[k] * get(kr + d);
        }
        s = warp_sum(s);
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new), e = expf(s - m_new);
        l = l * correction + e;
        const T* vr = v_cache + row * kv_width + kv_off;
        for (int k = 0; k < MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            acc[k] = acc[k] * correction + (d < head_dim ? e * get(vr + d) : 0.0f);
        }
        m = m_new;
    }
    // Merge the warps: rescale each to the common maximum.
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][MAX_PER_LANE * 32];
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
    for (int k = 0; k < MAX_PER_LANE; k++) wacc[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    float* oh = out + ((u64)t * n_heads + h) * head_dim;
    float gm = wm[0];
    for (int w = 1; w < ATTN_WARPS; w++) gm = fmaxf(gm, wm[w]);
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++) total += wl[w] == 0.0f ? 0.0f : wl[w] * expf(wm[w] - gm);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (wl[w] != 0.0f) o += wacc[w][d] * expf(wm[w] - gm);
        oh[d] = o / total;
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
