// The index of the largest of n values of each row, for greedy decoding on the device: the lowest
// index on ties, NaN counted as -inf (a row with nothing above -inf gives 0, still a token id).
//
// A row is spread over blocks (gridDim.x) so that it is read at the memory's speed, which one
// block alone cannot reach. Each block folds its best into the row's 64-bit key (the value's
// bits, ordered, above the inverted index) with one atomicMax; the last block to arrive writes
// the index, also to `chosen` when given (page-locked host memory the kernel writes directly,
// which saves a copy after it), and zeroes the key and count for the next launch.
// Given `position`, it also writes there the position after `*chosen_at` (one row: the next
// step's input, read before the wait like every step input, so it adds no round trip).
// Given `allowed` (a constraint's bits, one word per 32 values of a row), values whose bit is
// clear count as -inf.
#define ARGMAX_THREADS 256
#define ARGMAX_PER_THREAD 8
#define ARGMAX_PER_BLOCK (ARGMAX_THREADS * ARGMAX_PER_THREAD)

__device__ __forceinline__ u64 argmax_key(float v, int i) {
    u32 bits = v != v ? 0xff800000u : __float_as_uint(v);
    u32 ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ((u64)ordered << 32) | (0xffffffffu - (u32)i);
}

extern "C" __global__ void argmax(ArgmaxParams p) {
    const float* rows = p.rows;
    int n = p.n;
    u32 *outs = p.outs, *chosen = p.chosen, *position = p.position, *arrivals = p.arrivals;
    const u32* chosen_at = p.chosen_at;
    u64* keys = p.keys;
    u32 next_position = position && threadIdx.x == 0 ? *chosen_at + 1 : 0;
    begin_after_inputs();
    const float* x = rows + (u64)blockIdx.y * n;
    const u32* bits = p.allowed ? p.allowed + (u64)blockIdx.y * ((n + 31) / 32) : nullptr;
    const int first = blockIdx.x * ARGMAX_PER_BLOCK + threadIdx.x;
    // All loads before any compare: one at a time, each would wait out a memory round trip.
    float vals[ARGMAX_PER_THREAD];
    u32 words[ARGMAX_PER_THREAD];
#pragma unroll
    for (int u = 0; u < ARGMAX_PER_THREAD; u++) {
        int i = first + u * ARGMAX_THREADS;
        vals[u] = i < n ? x[i] : 0.0f;
        words[u] = bits && i < n ? bits[i / 32] : 0xffffffffu;
    }
#pragma unroll
    for (int u = 0; u < ARGMAX_PER_THREAD; u++) {
        int i = first + u * ARGMAX_THREADS;
        if (!((words[u] >> (i % 32)) & 1u)) vals[u] = __uint_as_float(0xff800000u);  // -inf
    }
    u64 best = 0;  // below every value's key
#pragma unroll
    for (int u = 0; u < ARGMAX_PER_THREAD; u++) {
        int i = first + u * ARGMAX_THREADS;
        if (i < n) best = max(best, argmax_key(vals[u], i));
    }
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ u64 warp_best[ARGMAX_THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) best = max(best, warp_best[w]);
    u64* key = keys + blockIdx.y;
    atomicMax(key, best);
    __threadfence();
    if (atomicAdd(arrivals + blockIdx.y, 1u) != gridDim.x - 1) return;
    // The last block: every other block's atomicMax came before its count.
    u32 idx = 0xffffffffu - (u32)atomicExch(key, 0ull);
    arrivals[blockIdx.y] = 0;
    outs[blockIdx.y] = idx;
    if (chosen) chosen[blockIdx.y] = idx;
    if (position) *position = next_position;
}
