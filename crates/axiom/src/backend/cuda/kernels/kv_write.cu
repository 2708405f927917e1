// Stores each token's K and V rows (f32) in its sequence's cache row for positions[t], as f16
// or f32 (see page_row in common.cuh for the paged layout).
__device__ __forceinline__ void put(u16* p, float v) { *p = f32_to_f16(v); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }

template <typename T>
__device__ void kv_write(const float* k, const float* v, T* k_cache, T* v_cache, const u32* positions,
                         const u32* tables, int table_width, const u32* token_seqs, int page_size, int kv_width) {
    begin_after_inputs();
    int t = blockIdx.x;
    const u32* table = tables + (u64)token_seqs[t] * table_width;
    u64 dst = page_row(table, page_size, positions[t]) * kv_width, src = (u64)t * kv_width;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        put(k_cache + dst + i, k[src + i]);
        put(v_cache + dst + i, v[src + i]);
    }
}

#define KV_WRITE(NAME, T)                                                                                        \
    extern "C" __global__ void kv_write_##NAME(KvWriteParams p) {                                                \
        kv_write(p.k, p.v, (T*)p.k_cache, (T*)p.v_cache, p.positions, p.tables, p.table_width, p.token_seqs,     \
                 p.page_size, p.width);                                                                          \
    }
KV_WRITE(f16, u16)
KV_WRITE(f32, float)
