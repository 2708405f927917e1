// The last step of a mixture of experts: residual[t] += sum_j weights[t * k + j] * rows[t * k + j],
// each token's k expert outputs (matmul_experts_* of the down matrices) in the order of its
// choices, as cpu/kernels/experts.rs adds them. One thread per value of the residual.
kernel void experts_sum(device float* residual [[buffer(0)]], device const float* rows [[buffer(1)]],
                        device const float* weights [[buffer(2)]], constant uint& n [[buffer(3)]],
                        constant uint& width [[buffer(4)]], constant uint& k [[buffer(5)]],
                        uint i [[thread_position_in_grid]]) {
    if (i >= n) return;
    uint t = i / width, c = i % width;
    float r = residual[i];
    for (uint j = 0; j < k; j++) r += weights[t * k + j] * rows[ulong(t * k + j) * width + c];
    residual[i] = r;
}
