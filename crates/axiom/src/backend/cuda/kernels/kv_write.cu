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

extern "C" __global__ void kv_write_f16(const float* k, const float* v, u16* kc, u16* vc, const u32* pos,
                                        const u32* tables, int table_width, const u32* token_seqs, int page_size,
                                        int width) {
    kv_write(k, v, kc, vc, pos, tables, table_width, token_seqs, page_size, width);
}
extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* kc, float* vc, const u32* pos,
                                        const u32* tables, int table_width, const u32* token_seqs, int page_size,
                                        int width) {
    kv_write(k, v, kc, vc, pos, tables, table_width, token_seqs, page_size, width);
}
