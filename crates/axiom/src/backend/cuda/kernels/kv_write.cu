// Stores each token's K and V rows (f32) at row positions[t] of the f16 caches.
extern "C" __global__ void kv_write(const float* k, const float* v, u16* k_cache, u16* v_cache, const u32* positions,
                                    int kv_width) {
    int t = blockIdx.x;
    u64 dst = (u64)positions[t] * kv_width, src = (u64)t * kv_width;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        k_cache[dst + i] = f32_to_f16(k[src + i]);
        v_cache[dst + i] = f32_to_f16(v[src + i]);
    }
}
