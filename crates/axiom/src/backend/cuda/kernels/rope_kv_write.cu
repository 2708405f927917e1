// RoPE on Q and K and the KV-cache write in one launch, for the start of a layer's attention.
// Grid: (tokens, n_heads + n_kv_heads). A block rotates one query head, or one key head and then
// stores that key head and its value head in the token's cache row (page_row in common.cuh).
template <typename T>
__device__ void rope_kv_write(float* q, float* k, const float* v, T* k_cache, T* v_cache, const u32* positions,
                              const float* freqs, const u32* tables, int table_width, const u32* token_seqs,
                              int page_size, int n_heads, int n_kv_heads, int head_dim, int dims, int halves) {
    begin_after_inputs();
    int t = blockIdx.x, h = blockIdx.y;
    if (h < n_heads) {
        rotate_head(q + ((u64)t * n_heads + h) * head_dim, positions[t], freqs, dims, halves);
        return;
    }
    int kh = h - n_heads;
    u64 src = ((u64)t * n_kv_heads + kh) * head_dim;
    rotate_head(k + src, positions[t], freqs, dims, halves);
    __syncthreads();  // the rotated head is complete before it is stored
    const u32* table = tables + (u64)token_seqs[t] * table_width;
    u64 dst = page_row(table, page_size, positions[t]) * n_kv_heads * head_dim + (u64)kh * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        put(k_cache + dst + i, k[src + i]);
        put(v_cache + dst + i, v[src + i]);
    }
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
