// Rotates pairs of a head by pos * freqs[i], the block's threads taking the pairs in turn;
// `halves` selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1). `store(a, b, xa, xb)`
// puts the rotated values of pair (a, b) wherever they go.
template <typename Store>
__device__ __forceinline__ void rotate_pairs(const float* head, u32 pos, const float* freqs, int dims, int halves,
                                             Store store) {
    int half = dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        // The angle in double precision, as the CPU reference computes it.
        double s, c;
        sincos((double)pos * (double)freqs[i], &s, &c);
        int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        store(a, b, (float)(x0 * c - x1 * s), (float)(x0 * s + x1 * c));
    }
}

// A head rotated in place.
__device__ __forceinline__ void rotate_head(float* head, u32 pos, const float* freqs, int dims, int halves) {
    rotate_pairs(head, pos, freqs, dims, halves, [&](int a, int b, float xa, float xb) {
        head[a] = xa;
        head[b] = xb;
    });
}

// Grid: (tokens, heads).
extern "C" __global__ void rope(float* x, const u32* positions, const float* freqs, int n_heads, int head_dim, int dims,
                                int halves) {
    begin_after_inputs();
    int t = blockIdx.x, h = blockIdx.y;
    rotate_head(x + ((u64)t * n_heads + h) * head_dim, positions[t], freqs, dims, halves);
}
