// Elementwise ops, one thread per value.

// out = act(gate) * up (`activate` in common.metal)
kernel void glu(device const float* gate [[buffer(0)]], device const float* up [[buffer(1)]],
                device float* out [[buffer(2)]], constant uint& n [[buffer(3)]], constant uint& act [[buffer(4)]],
                uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    out[i] = activate(gate[i], act) * up[i];
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

// x *= factor
kernel void scale(device float* x [[buffer(0)]], constant uint& n [[buffer(1)]], constant float& factor [[buffer(2)]],
                  uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    x[i] *= factor;
}

// x = cap * tanh(x / cap)
kernel void softcap(device float* x [[buffer(0)]], constant uint& n [[buffer(1)]], constant float& cap [[buffer(2)]],
                    uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    x[i] = cap * precise::tanh(x[i] / cap);
}

// x[t] += sigmoid(gates[t]) * rows[t], rows of `width` (a gated shared expert)
kernel void add_gated(device float* x [[buffer(0)]], device const float* rows [[buffer(1)]],
                      device const float* gates [[buffer(2)]], constant uint& n [[buffer(3)]],
                      constant uint& width [[buffer(4)]], uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    float s = 1.0f / (1.0f + exp(-gates[i / width]));
    x[i] += s * rows[i];
}
