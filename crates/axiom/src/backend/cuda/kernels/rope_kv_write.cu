// RoPE on Q and K and the KV-cache write in one launch, for the start of a layer's attention.
// Grid: (tokens, n_heads + n_kv_heads). A block rotates one query head in place, or one key head
// in place and into the token's cache row (page_row in common.cuh), copying its value head there
// too. The cache row is looked up before the rotation, so a key block waits for two rounds of
// loads (the token's sequence, then its page), not four.
template <typename T>
__device__ void rope_kv_write(float* q, float* k, const float* v, T* k_cache, T* v_cache, const u32* positions,
                              const float* freqs, const u32* tables, int table_width, const u32* token_seqs,
                              int page_size, int n_heads, int n_kv_heads, int head_dim, int dims, int halves) {
    begin_after_inputs();
    int t = blockIdx.x, h = blockIdx.y;
    u32 pos = positions[t];
    if (h < n_heads) {
        rotate_head(q + ((u64)t * n_heads + h) * head_dim, pos, freqs, dims, halves);
        return;
    }
    int kh = h - n_heads;
    u64 src = ((u64)t * n_kv_heads + kh) * head_dim;
    const u32* table = tables + (u64)token_seqs[t] * table_width;
    u64 dst = page_row(table, page_size, pos) * n_kv_heads * head_dim + (u64)kh * head_dim;
    float* head = k + src;
    rotate_pairs(head, pos, freqs, dims, halves, [&](int a, int b, float xa, float xb) {
        head[a] = xa;
        head[b] = xb;
        put(k_cache + dst + a, xa);
        put(k_cache + dst + b, xb);
    });
    for (int i = dims + threadIdx.x; i < head_dim; i += blockDim.x) put(k_cache + dst + i, head[i]);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) put(v_cache + dst + i, v[src + i]);
}

#define ROPE_KV_WRITE(NAME, T)                                                                                     \
    extern "C" __global__ void rope_kv_write_##NAME(float* q, float* k, const float* v, T* kc, T* vc,              \
                                                    const u32* positions, const float* freqs, const u32* tables,   \
                                                    int table_width, const u32* token_seqs, int page_size,         \
                                                    int n_heads, int n_kv_heads, int head_dim, int dims, int halves) { \
        rope_kv_write(q, k, v, kc, vc, positions, freqs, tables, table_width, token_seqs, page_size, n_heads,      \
                      n_kv_heads, head_dim, dims, halves);                                                         \
    }
ROPE_KV_WRITE(f16, u16)
ROPE_KV_WRITE(f32, float)
