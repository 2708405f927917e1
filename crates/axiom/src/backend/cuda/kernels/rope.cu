// Rotates pairs of each head in place by positions[t] * freqs[i]. Grid: (tokens, heads);
// `halves` selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1).
extern "C" __global__ void rope(float* x, const u32* positions, const float* freqs, int n_heads, int head_dim, int dims,
                                int halves) {
    int t = blockIdx.x, h = blockIdx.y;
    float* head = x + ((u64)t * n_heads + h) * head_dim;
    double pos = (double)positions[t];
    int half = dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        // The angle in double precision, as the CPU reference computes it.
        double s, c;
        sincos(pos * (double)freqs[i], &s, &c);
        int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = (float)(x0 * c - x1 * s);
        head[b] = (float)(x0 * s + x1 * c);
    }
}
