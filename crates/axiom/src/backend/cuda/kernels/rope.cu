// Rotates pairs of each head in place by pos * theta^(-2i/dims). Grid: (tokens, heads);
// `halves` selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1).
extern "C" __global__ void rope(float* x, const u32* positions, int n_heads, int head_dim, int dims, float theta,
                                int halves) {
    int t = blockIdx.x, h = blockIdx.y;
    float* head = x + ((u64)t * n_heads + h) * head_dim;
    float pos = (float)positions[t];
    int half = dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        // The angle in double precision, as the CPU reference computes it.
        double freq = pow((double)theta, -2.0 * i / dims);
        double s, c;
        sincos((double)pos * freq, &s, &c);
        int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = (float)(x0 * c - x1 * s);
        head[b] = (float)(x0 * s + x1 * c);
    }
}
