// (cos, sin) of pair i's angle at position pos, pos * freqs[i], times `scale` (YaRN's and
// LongRoPE's attention factor), in double precision as the CPU reference computes it.
__device__ __forceinline__ double2 turn(u32 pos, const float* freqs, int i, float scale) {
    double s, c;
    sincos((double)pos * (double)freqs[i], &s, &c);
    return make_double2(c * scale, s * scale);
}

// The pair (x0, x1) rotated by the angle whose (cos, sin) is cs.
__device__ __forceinline__ float2 rotated(float x0, float x1, double2 cs) {
    return make_float2((float)(x0 * cs.x - x1 * cs.y), (float)(x0 * cs.y + x1 * cs.x));
}

// Rotates pairs of a head by pos * freqs[i], scaled, the block's threads taking the pairs in
// turn; `halves` selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1).
// `store(a, b, xa, xb)` puts the rotated values of pair (a, b) wherever they go.
template <typename Store>
__device__ __forceinline__ void rotate_pairs(const float* head, u32 pos, const float* freqs, int dims, int halves,
                                             float scale, Store store) {
    int half = dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        float2 x = rotated(head[a], head[b], turn(pos, freqs, i, scale));
        store(a, b, x.x, x.y);
    }
}

// A head rotated in place.
__device__ __forceinline__ void rotate_head(float* head, u32 pos, const float* freqs, int dims, int halves,
                                            float scale) {
    rotate_pairs(head, pos, freqs, dims, halves, scale, [&](int a, int b, float xa, float xb) {
        head[a] = xa;
        head[b] = xb;
    });
}

// Grid: (tokens, heads).
extern "C" __global__ void rope(RopeParams p) {
    float* x = p.x;
    const u32* positions = p.positions;
    const float* freqs = p.freqs;
    int n_heads = p.n_heads, head_dim = p.head_dim, dims = p.dims, halves = p.halves;
    begin_after_inputs();
    int t = blockIdx.x, h = blockIdx.y;
    rotate_head(x + ((u64)t * n_heads + h) * head_dim, positions[t], freqs, dims, halves, p.scale);
}
