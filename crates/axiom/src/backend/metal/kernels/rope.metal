// Rotates pairs of a head in place by pos * freqs[i], cosine and sine times `scale` (YaRN's and
// LongRoPE's attention factor), the threadgroup's threads taking the pairs in turn; `halves`
// selects the (i, i + dims/2) pairing, else adjacent (2i, 2i+1). The angle is f32 (MSL has no
// double), with the precise sine and cosine.
inline void rotate_head(device float* head, uint position, device const float* freqs, uint dims, uint halves,
                        float scale, uint tid, uint threads) {
    float pos = float(position);
    uint n_pairs = dims / 2;
    for (uint i = tid; i < n_pairs; i += threads) {
        float c;
        float s = precise::sincos(pos * freqs[i], c) * scale;
        c *= scale;
        uint a = halves != 0 ? i : 2 * i, b = halves != 0 ? i + n_pairs : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// One threadgroup per (token, head). Grid attributes of a kernel share one shape (here two
// dimensions), so the threads come as an index and a two-component size.
kernel void rope(device float* x [[buffer(0)]], device const uint* positions [[buffer(1)]],
                 device const float* freqs [[buffer(2)]], constant uint& n_heads [[buffer(3)]],
                 constant uint& head_dim [[buffer(4)]], constant uint& dims [[buffer(5)]],
                 constant uint& halves [[buffer(6)]], constant float& scale [[buffer(7)]],
                 uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                 uint2 group_size [[threads_per_threadgroup]]) {
    uint t = group.x, h = group.y;
    rotate_head(x + (ulong(t) * n_heads + h) * head_dim, positions[t], freqs, dims, halves, scale, tid,
                group_size.x);
}
