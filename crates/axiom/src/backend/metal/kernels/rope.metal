// Rotates pairs of each head in place by positions[t] * freqs[i]. One threadgroup per (token,
// head); `halves` selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1). The angle is
// f32 (MSL has no double), with the precise sine and cosine.
kernel void rope(device float* x [[buffer(0)]], device const uint* positions [[buffer(1)]],
                 device const float* freqs [[buffer(2)]], constant uint& n_heads [[buffer(3)]],
                 constant uint& head_dim [[buffer(4)]], constant uint& dims [[buffer(5)]],
                 constant uint& halves [[buffer(6)]], uint2 group [[threadgroup_position_in_grid]],
                 uint tid [[thread_index_in_threadgroup]], uint2 group_size [[threads_per_threadgroup]]) {
    // Grid attributes of a kernel share one shape (here two-dimensional); the threads are a row.
    uint t = group.x, h = group.y, threads = group_size.x;
    device float* head = x + (ulong(t) * n_heads + h) * head_dim;
    float pos = float(positions[t]);
    uint n_pairs = dims / 2;
    for (uint i = tid; i < n_pairs; i += threads) {
        float c;
        float s = precise::sincos(pos * freqs[i], c);
        uint a = halves != 0 ? i : 2 * i, b = halves != 0 ? i + n_pairs : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}
