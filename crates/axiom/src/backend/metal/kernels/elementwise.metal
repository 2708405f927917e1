// Elementwise ops, one thread per value.

// out = silu(gate) * up
kernel void swiglu(device const float* gate [[buffer(0)]], device const float* up [[buffer(1)]],
                   device float* out [[buffer(2)]], constant uint& n [[buffer(3)]],
                   uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    float g = gate[i];
    out[i] = g / (1.0f + exp(-g)) * up[i];
}

// x += y
kernel void add(device float* x [[buffer(0)]], device const float* y [[buffer(1)]], constant uint& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    x[i] += y[i];
}

// x[t] += bias, rows of `width`
kernel void add_bias(device float* x [[buffer(0)]], device const float* bias [[buffer(1)]],
                     constant uint& n [[buffer(2)]], constant uint& width [[buffer(3)]],
                     uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    x[i] += bias[i % width];
}
