// Matrix-vector products for decode, straight from the stored weight type: out[t, o] =
// sum_i x[t, i] * w[o, i] for T tokens at once. One warp per output row; the lanes take the
// row's 32-value chunks in turn (each one 16- or 32-byte aligned load of quants), so a warp
// streams its row once for all T tokens.
__device__ __forceinline__ float dot16(const float* y, const float* x) {
    const float4* xv = (const float4*)x;
    float s = 0.0f;
    for (int k = 0; k < 4; k++) {
        float4 v = xv[k];
        s += y[4 * k] * v.x + y[4 * k + 1] * v.y + y[4 * k + 2] * v.z + y[4 * k + 3] * v.w;
    }
    return s;
}

// Up to three matrices of one type multiplied by the same activations in one launch (Q, K and V;
// gate and up): their rows are taken in order, one warp each, eight warps a block. The GLU
// kernels take a gate and an up matrix and write silu(gate) * up, the feed-forward block's first
// half with its SwiGLU folded in. A warp of R >= 2 rows takes R / 2 rows of the gate matrix and the
// same rows of the up matrix, and writes their outputs itself; warps of one row pair up, a block's
// warps 0-3 taking four rows of the gate matrix and warps 4-7 the same rows of the up matrix,
// which hand their sums over through shared memory. (Q4_K's one-token kernel takes two rows a
// warp, so it pairs within the warp: fewer registers and no barrier.)
// Their weights, outputs and rows come in `Matrices` (params.cuh).

// This warp's first row (ok is false for a warp past the last row); with GLU and R >= 2, of the
// gate matrix w and of up.
struct Picked {
    Weight w, up;
    float* out;
    int n_out;
    int row;
    bool ok;
};

// A matrix's rows are taken R at a time, so a warp's rows never straddle two matrices. The loop is
// unrolled so that the parameters are indexed by constants: a run-time index would copy them to
// local memory, and the weights' pointers with them.
template <bool GLU, int R>
__device__ __forceinline__ Picked pick_row(const Matrices& mats, int n_in) {
    int warp = threadIdx.x / 32;
    if constexpr (GLU) {
        Weight gate{mats.q[0], mats.s[0], mats.m[0], n_in}, up{mats.q[1], mats.s[1], mats.m[1], n_in};
        if (R >= 2) {
            int r = (blockIdx.x * 8 + warp) * (R / 2);
            return Picked{gate, up, mats.out[0], mats.n_out[0], r, r < mats.n_out[0]};
        }
        int r = blockIdx.x * 4 + warp % 4;
        return Picked{warp < 4 ? gate : up, Weight{}, mats.out[0], mats.n_out[0], r, r < mats.n_out[0]};
    }
    int k = blockIdx.x * 8 + warp;  // this warp's place among all matrices' warps
#pragma unroll
    for (int i = 0; i < MAX_MATRICES; i++) {
        int warps = (mats.n_out[i] + R - 1) / R;
        if (i < mats.count && k < warps)
            return Picked{Weight{mats.q[i], mats.s[i], mats.m[i], n_in}, Weight{}, mats.out[i], mats.n_out[i], k * R, true};
        k -= warps;
    }
    return Picked{Weight{nullptr, nullptr, nullptr, n_in}, Weight{}, nullptr, 0, 0, false};
}

// Every matrix-vector kernel, after its PDL wait (or with it inside `row_dot`: ReadsBeforeWait):
// `row_dot(w, up, row, n_rows, acc, inputs_ready)` leaves a warp's per-lane partial dot products
// of R rows from `row` on with the T tokens' activations in acc (row r's for token t at r * T + t);
// rows past n_rows are not stored. With GLU and R >= 2 the rows are R / 2 of the gate matrix w
// and the same rows of up, and n_rows counts the gate's. It calls inputs_ready() once, after the
// wait, which then loads the values an accumulating product adds to: their trip to memory
// overlaps the products instead of following them.
template <int TY, int T, bool GLU, int R, typename RowDot>
__device__ __forceinline__ void gemv_rows(const Matrices& mats, int n_in, RowDot row_dot) {
    __shared__ float up_sums[4][R * T];
    Picked p = pick_row<GLU, R>(mats, n_in);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[R * T], prior[R * T];
    constexpr bool paired = GLU && R >= 2;  // a warp's gate and up rows (pick_row)
    int n_rows = R == 1 ? 1 : min(paired ? R / 2 : R, p.n_out - p.row);
    auto out = [&](int r, int t) { return p.out + (u64)t * p.n_out + p.row + r; };
    auto inputs_ready = [&] {
        if (!GLU && mats.accumulate && lane == 0)
            for (int r = 0; r < n_rows; r++)
                for (int t = 0; t < T; t++) prior[r * T + t] = *out(r, t);
    };
    if (p.ok) {
        row_dot(p.w, p.up, p.row, n_rows, acc, inputs_ready);
        for (int i = 0; i < R * T; i++) acc[i] = warp_sum(acc[i]);
    }
    if (!GLU) {
        if (p.ok && lane == 0)
            for (int r = 0; r < n_rows; r++)
                for (int t = 0; t < T; t++) {
                    float sum = acc[r * T + t];
                    *out(r, t) = mats.accumulate ? prior[r * T + t] + sum : sum;
                }
        return;
    }
    // silu by the fast exponential and division (a few ulp): the exact ones' range checks and slow
    // paths were most of the epilogue's instructions.
    auto swiglu = [](float gate, float up) { return __fdividef(gate, 1.0f + __expf(-gate)) * up; };
    if (paired) {
        if (p.ok && lane == 0)
            for (int r = 0; r < n_rows; r++)
                for (int t = 0; t < T; t++) *out(r, t) = swiglu(acc[r * T + t], acc[(r + R / 2) * T + t]);
        return;
    }
    // The up warps hand their sums to the gate warps.
    if (p.ok && warp >= 4 && lane == 0)
        for (int i = 0; i < R * T; i++) up_sums[warp % 4][i] = acc[i];
    __syncthreads();
    if (p.ok && warp < 4 && lane == 0)
        for (int r = 0; r < n_rows; r++)
            for (int t = 0; t < T; t++) *out(r, t) = swiglu(acc[r * T + t], up_sums[warp][r * T + t]);
}

// Quantized weights on f32 activations: each lane expands its 32-value chunks to floats.
template <int TY, int T>
__device__ __forceinline__ void quant_row(const Weight& w, int row, const float* x, float* acc) {
    int lane = threadIdx.x % 32;
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    float y[32];
    for (int c = lane; c < w.n_in / 32; c += 32) {
        int at0, at1;
        chunk<TY>(w, row, c, y, &at0, &at1);
        for (int t = 0; t < T; t++) {
            const float* xt = x + (u64)t * w.n_in;
            acc[t] += dot16(y, xt + at0) + dot16(y + 16, xt + at1);
        }
    }
}

// The same products on integers, for large quantized matrices: the activations are first
// quantized per 32 values to int8 with one f32 scale (quantize_q8), then each run of 16 weights is
// dotted with its 16 activations by four dp4a; the run's scale and offset (IntChunk) and the
// activations' scale come in once per run. Far fewer instructions per weight byte than widening
// every value to f32.
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The activations quantized by store_q8x4 (common.cuh), four values a thread: rows of n_in (a
// multiple of 32; of 256 with `interleave`), n values in all. With start_next, as rms_norm_q8.
extern "C" __global__ void quantize_q8(QuantizeQ8Params p) {
    const float4* x = p.x;
    u32* xq = p.xq;
    float* xd = p.xd;
    u64 n = p.n;
    int n_in = p.n_in, interleave = p.interleave, start_next = p.start_next;
    begin_after_inputs();
    if (start_next) start_dependents();
    u64 i4 = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    bool valid = i4 < n / 4;
    u64 row_start = 4 * i4 / n_in * n_in;
    u64 slot4 = (row_start + q8_slot((int)(4 * i4 - row_start), n_in, interleave)) / 4;
    store_q8x4(valid ? x[i4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f), valid, xq, xd, i4, slot4, interleave);
}

// Whether a type's runs have offsets (minimums): only then is the activations' sum needed.
template <int TY> struct HasOffset { static const bool value = TY == TY_Q4_1 || TY == TY_Q4_K; };
// Whether a type's kernels take their activations interleaved, each block's scale beside its sum
// (as `interleaves_activations` in cuda/matmul.rs): the K-quants', which run on kquant_rows.
template <int TY> struct InterleavesActivations { static const bool value = TY == TY_Q4_K || TY == TY_Q6_K; };

template <int TY, int T>
__device__ __forceinline__ void dot_chunk(const IntChunk& k, const i8* xq, const float* xd, int n_in, float* acc) {
    for (int t = 0; t < T; t++) {
        u64 xt = (u64)t * n_in;
        for (int r = 0; r < 2; r++) {
            uint4 xv = *(const uint4*)(xq + xt + k.at[r]);
            int dot = dp4a(k.q[4 * r], xv.x, 0);
            dot = dp4a(k.q[4 * r + 1], xv.y, dot);
            dot = dp4a(k.q[4 * r + 2], xv.z, dot);
            dot = dp4a(k.q[4 * r + 3], xv.w, dot);
            float run = k.scale[r] * (float)dot;
            if (HasOffset<TY>::value) {
                int sum = dp4a(0x01010101u, xv.x, dp4a(0x01010101u, xv.y, dp4a(0x01010101u, xv.z, dp4a(0x01010101u, xv.w, 0))));
                run += k.offset[r] * (float)sum;
            }
            acc[t] += xd[(xt + k.at[r]) / 32] * run;
        }
    }
}

// Whether a type's kernels read weights before the wait for the kernel before
// (begin_after_inputs): weights are not written during a step, so the read overlaps that kernel
// where it lets this one start early (start_dependents). Q8_0 reads each lane's first chunk, Q4_K
// and Q6_K copy their first stage (kquant_rows). Their one-token kernels also let the kernel after
// them start early, from their first instruction: its blocks (a norm, RoPE, a quantization,
// argmax; a few blocks each) then wait on the multiprocessors for this one's end instead of being
// launched at it, which hides their launch.
template <int TY> struct ReadsBeforeWait {
    static const bool value = TY == TY_Q8_0 || TY == TY_Q4_K || TY == TY_Q6_K;
};

// Rows a warp of the one-token Q4_K integer kernel takes (kquant_rows; Q4K_ROWS in
// cuda/matmul.rs). With more tokens, one: two rows would take over 96 registers. Q6_K's warps
// take one row: two rows' stages of its larger groups would pass the 48 KB of static shared
// memory a block may have.
#define Q4K_ROWS 2
template <int TY, int T> struct RowsPerWarp { static const int value = TY == TY_Q4_K && T == 1 ? Q4K_ROWS : 1; };
template <int TY, int T, int R, bool GLU, typename Ready>
__device__ __forceinline__ void kquant_rows(const Weight& w, const Weight& up, int row, int n_rows, const i8* xq,
                                            const float* xd, float* acc, Ready inputs_ready, bool copy_whole);

// One chunk is decoded ahead of its use; decoding two or four ahead was slower.
template <int TY, int T, bool GLU, typename Ready>
__device__ __forceinline__ void int_row(const Weight& w, const Weight& up, int row, int n_rows, const i8* xq,
                                        const float* xd, float* acc, Ready inputs_ready, bool copy_whole) {
    if constexpr (InterleavesActivations<TY>::value)
        return kquant_rows<TY, T, RowsPerWarp<TY, T>::value, GLU>(w, up, row, n_rows, xq, xd, acc, inputs_ready,
                                                                  copy_whole);
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    if (!ReadsBeforeWait<TY>::value) {
        inputs_ready();
        for (int c = threadIdx.x % 32; c < w.n_in / 32; c += 32)
            dot_chunk<TY, T>(int_chunk<TY>(w, row, c), xq, xd, w.n_in, acc);
        return;
    }
    int c = threadIdx.x % 32, n_chunks = w.n_in / 32;
    IntChunk k = c < n_chunks ? int_chunk<TY>(w, row, c) : IntChunk{};
    begin_after_inputs();
    inputs_ready();
    for (; c < n_chunks; c += 32) {
        dot_chunk<TY, T>(k, xq, xd, w.n_in, acc);
        if (c + 32 < n_chunks) k = int_chunk<TY>(w, row, c + 32);
    }
}

// Q4_K and Q6_K have their own kernel: a lane takes a group of quants, 64 values (Q4_K: 32 bytes,
// sub-blocks 2j and 2j+1 of a super-block, low and high nibbles; Q6_K: 48 bytes, four runs of 16),
// and applies each sub-block's scale (and minimum) once to its integer dot product: half the
// instructions per weight byte of the chunk-a-lane loop above. Quants and activations are interleaved (common.cuh), so every warp load is
// contiguous. For one token a warp takes Q4K_ROWS rows, so that each activation load serves them
// all and a warp's fixed cost (its start, the round trip to memory, the reductions) is spread
// over more bytes. Its quants and metadata pass through shared memory by cp.async, a stage of
// Q4K_STAGED_GROUPS groups across its rows while the one before is used; the first stage is
// copied before the wait. (Four rows a warp would need too many registers.) The kernel is bound
// by its instruction issue more than by memory, so each group's arithmetic is pared down: the
// high nibbles masked in place rather than shifted (nibble_dots), each lane's scale bytes picked
// by masks fixed for the lane (Q4kPair), the 6-bit scales applied on integers, and the
// activations' block sums taken from the quantization (store_q8_scale) instead of summed by every
// warp. So is a warp's fixed cost, as large as its groups' arithmetic: each lane's copy and
// activation addresses are found once, and the copies are unrolled under predicates instead of
// run as loops over a stage.
#define GEMV_WARPS 8
#define Q4K_STAGED_GROUPS 64  // a stage of all of a warp's rows
#define Q6K_STAGED_GROUPS 32  // a stage of its one row: a group a lane

// dp4a with a's bytes unsigned (Q4_K's quants, 0..15) and b's signed.
__device__ __forceinline__ int dp4a_unsigned(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The dot products of a Q4_K group (32 bytes: quants q0 then q1) with its 64 activations: the low
// nibbles with x0, x1 and the high ones with x2, x3. The high nibbles stay in place, 16 times
// their value (the caller scales by 1/16, exactly), which saves their shifts; four chains of four,
// so that they overlap.
__device__ __forceinline__ int2 nibble_dots(uint4 q0, uint4 q1, uint4 x0, uint4 x1, uint4 x2, uint4 x3) {
    const u32 lo = 0x0f0f0f0fu, hi = 0xf0f0f0f0u;
    int a = dp4a_unsigned(q0.x & lo, x0.x, 0), b = dp4a_unsigned(q1.x & lo, x1.x, 0);
    int c = dp4a_unsigned(q0.x & hi, x2.x, 0), d = dp4a_unsigned(q1.x & hi, x3.x, 0);
    a = dp4a_unsigned(q0.y & lo, x0.y, a), b = dp4a_unsigned(q1.y & lo, x1.y, b);
    c = dp4a_unsigned(q0.y & hi, x2.y, c), d = dp4a_unsigned(q1.y & hi, x3.y, d);
    a = dp4a_unsigned(q0.z & lo, x0.z, a), b = dp4a_unsigned(q1.z & lo, x1.z, b);
    c = dp4a_unsigned(q0.z & hi, x2.z, c), d = dp4a_unsigned(q1.z & hi, x3.z, d);
    a = dp4a_unsigned(q0.w & lo, x0.w, a), b = dp4a_unsigned(q1.w & lo, x1.w, b);
    c = dp4a_unsigned(q0.w & hi, x2.w, c), d = dp4a_unsigned(q1.w & hi, x3.w, d);
    return make_int2(a + b, c + d);
}

// The 6-bit scales and minimums of a Q4_K lane's two sub-blocks. Lanes take a row's 32-byte
// groups in turn, so group g's sub-blocks, 2(g % 4) and 2(g % 4) + 1 of its super-block, are the
// same for every group a lane takes (g % 4 = lane % 4): they lie in one 16-bit half of each
// metadata word (q4k_scale_min), the same half for the lane each time, and for lanes 2 and 3 of
// four they are the 4-bit form with their top bits apart. `Q4kPair` holds what picks them.
struct Q4kPair {
    u32 shift;      // to the lane's half of each word
    bool split;     // lanes 2 and 3 of four: 4 bits in w, the top 2 in y (scales) and z (minimums)

    __device__ __forceinline__ Q4kPair(int lane) : shift(16 * (lane % 2)), split(lane % 4 >= 2) {}

    // The pair's scales and minimums, a byte each: scales in bytes 0 and 1, minimums in bytes 0
    // and 1 of the second word.
    __device__ __forceinline__ uint2 bytes(uint4 meta) const {
        u32 y = meta.y >> shift, z = meta.z >> shift, w = meta.w >> shift;
        u32 top_scales = (y >> 2) & 0x3030u, top_mins = (z >> 2) & 0x3030u;
        u32 scales = split ? (w & 0x0f0fu) | top_scales : y & 0x3f3fu;
        u32 mins = split ? ((w >> 4) & 0x0f0fu) | top_mins : z & 0x3f3fu;
        return make_uint2(scales, mins);
    }
};

// A group's activations for one token: four 16-byte pieces, and the two blocks' scales and sums
// (store_q8_scale in common.cuh).
struct GroupActivations {
    uint4 x0, x1, x2, x3;
    float4 scales_sums;
};

// A lane's Q4_K groups: `dot` is a group's product with its activations, from its staged quants
// (q, the others `width` pieces on) and its super-block's metadata.
struct Q4kLane {
    Q4kPair pair;

    __device__ __forceinline__ Q4kLane(int lane) : pair(lane) {}

    __device__ __forceinline__ float dot(const uint4* q, int width, const uint4* meta_at, float,
                                         const GroupActivations& a) const {
        uint4 q0 = q[0], q1 = q[width], meta = *meta_at;
        float2 d = make_float2(a.scales_sums.x, a.scales_sums.z);
        int sum_lo = __float_as_int(a.scales_sums.y), sum_hi = __float_as_int(a.scales_sums.w);
        float d_hi = d.y * 0.0625f;  // the high nibbles' dot products are 16 times theirs
        // Each sub-block's dot product and activation sum times its 6-bit scale and minimum on
        // integers (at most 2^26), then the super-block's d and dmin: one conversion a product,
        // not two.
        uint2 sm = pair.bytes(meta);
        int2 dots = nibble_dots(q0, q1, a.x0, a.x1, a.x2, a.x3);
        int scale_lo = sm.x & 0xff, scale_hi = sm.x >> 8, min_lo = sm.y & 0xff, min_hi = sm.y >> 8;
        float scaled = d.x * (float)(dots.x * scale_lo) + d_hi * (float)(dots.y * scale_hi);
        float shifted = d.x * (float)(sum_lo * min_lo) + d.y * (float)(sum_hi * min_hi);
        float d_super = f16_to_f32((u16)meta.x), d_min = f16_to_f32((u16)(meta.x >> 16));
        return d_super * scaled - d_min * shifted;
    }
};

// A lane's Q6_K groups (layout in dequant.cuh): the values are unsigned (the quant plus 32), so
// each run of 16's product less 32 times its activations' sum is the quants' product. Those sums
// come from the quantization's block sums (store_q8_scale) less the sums of runs 0 and 2, which
// dp4a takes here. A lane's groups are all the same quarter of their super-blocks (group % 4 =
// lane % 4), so their four scales are the same word of each super-block's 16, `word`.
struct Q6kLane {
    int word;

    __device__ __forceinline__ Q6kLane(int lane) : word(lane % 4) {}

    __device__ __forceinline__ float dot(const uint4* q, int width, const uint4* meta_at, float d,
                                         const GroupActivations& a) const {
        uint4 p0 = q[0], p1 = q[width], p2 = q[2 * width];
        u32 scales = ((const u32*)meta_at)[word];
        // Four chains, so that they overlap.
        int dot0 = dp4a_unsigned(q6k_low(p0.x), a.x0.x, 0), dot1 = dp4a_unsigned(q6k_low(p1.x), a.x1.x, 0);
        int dot2 = dp4a_unsigned(q6k_low(p2.x), a.x2.x, 0), dot3 = dp4a_unsigned(q6k_top(p0.x, p1.x, p2.x), a.x3.x, 0);
        dot0 = dp4a_unsigned(q6k_low(p0.y), a.x0.y, dot0), dot1 = dp4a_unsigned(q6k_low(p1.y), a.x1.y, dot1);
        dot2 = dp4a_unsigned(q6k_low(p2.y), a.x2.y, dot2), dot3 = dp4a_unsigned(q6k_top(p0.y, p1.y, p2.y), a.x3.y, dot3);
        dot0 = dp4a_unsigned(q6k_low(p0.z), a.x0.z, dot0), dot1 = dp4a_unsigned(q6k_low(p1.z), a.x1.z, dot1);
        dot2 = dp4a_unsigned(q6k_low(p2.z), a.x2.z, dot2), dot3 = dp4a_unsigned(q6k_top(p0.z, p1.z, p2.z), a.x3.z, dot3);
        dot0 = dp4a_unsigned(q6k_low(p0.w), a.x0.w, dot0), dot1 = dp4a_unsigned(q6k_low(p1.w), a.x1.w, dot1);
        dot2 = dp4a_unsigned(q6k_low(p2.w), a.x2.w, dot2), dot3 = dp4a_unsigned(q6k_top(p0.w, p1.w, p2.w), a.x3.w, dot3);
        const u32 ones = 0x01010101u;
        int sum0 = dp4a(ones, a.x0.x, dp4a(ones, a.x0.y, dp4a(ones, a.x0.z, dp4a(ones, a.x0.w, 0))));
        int sum2 = dp4a(ones, a.x2.x, dp4a(ones, a.x2.y, dp4a(ones, a.x2.z, dp4a(ones, a.x2.w, 0))));
        int sum1 = __float_as_int(a.scales_sums.y) - sum0, sum3 = __float_as_int(a.scales_sums.w) - sum2;
        // On integers (at most about 2^26), then one conversion for each block of 32 activations.
        int lo = (int)(i8)scales * (dot0 - 32 * sum0) + (int)(i8)(scales >> 8) * (dot1 - 32 * sum1);
        int hi = (int)(i8)(scales >> 16) * (dot2 - 32 * sum2) + ((int)scales >> 24) * (dot3 - 32 * sum3);
        return d * (a.scales_sums.x * (float)lo + a.scales_sums.z * (float)hi);
    }
};

// What kquant_rows takes of a type: its quant pieces a group, the groups a stage holds of each of
// R rows, whether a super-block's d (f32, in `m`) is staged after its metadata, and its Lane.
template <int TY> struct KQuant;
template <> struct KQuant<TY_Q4_K> {
    static constexpr int pieces = 2;
    static constexpr int stage_groups(int rows) { return Q4K_STAGED_GROUPS / rows; }
    static constexpr bool staged_d = false;
    typedef Q4kLane Lane;
};
template <> struct KQuant<TY_Q6_K> {
    static constexpr int pieces = 3;
    static constexpr int stage_groups(int) { return Q6K_STAGED_GROUPS; }
    static constexpr bool staged_d = true;
    typedef Q6kLane Lane;
};

template <int TY, int T, int R, bool GLU, typename Ready>
__device__ __forceinline__ void kquant_rows(const Weight& w, const Weight& up, int row, int n_rows, const i8* xq,
                                            const float* xd, float* acc, Ready inputs_ready, bool copy_whole) {
    typedef KQuant<TY> K;
    constexpr int stage_groups = K::stage_groups(R), quant_pieces = K::pieces * stage_groups;
    constexpr int meta_pieces = stage_groups / 4, d_pieces = K::staged_d ? stage_groups / 16 : 0;
    // A staged row: quants, then metadata, then (Q6_K) each super-block's d.
    constexpr int row_pieces = quant_pieces + meta_pieces + d_pieces;
    __shared__ __align__(16) uint4 stage[GEMV_WARPS][2][R][row_pieces];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_groups = (u32)w.n_in / 64;
    // Each lane's first source and destination of every row, found once: a warp short of rows
    // copies its last one again. A stage's groups start at a multiple of stage_groups, so whole
    // tiles: its quant pieces lie together, interleaved as in memory. Paired, rows R / 2 on are
    // up's (gemv_rows).
    constexpr bool paired = GLU && R >= 2;
    const uint4 *quants[R], *metas[R];
    const float* ds[R];
    for (int r = 0; r < R; r++) {
        bool of_up = paired && r >= R / 2;
        const Weight& m = of_up ? up : w;
        u64 from = row + min(of_up ? r - R / 2 : r, n_rows - 1);
        quants[r] = (const uint4*)(m.q + from * (m.n_in / 4 * K::pieces)) + lane;
        metas[r] = (const uint4*)(m.s + from * (m.n_in / 256) * 16) + lane;
        ds[r] = (const float*)m.m + from * (m.n_in / 256);
    }
    u32 staged_base = shared_address(stage[warp][0][0]), staged_at = staged_base + 16 * lane;
    // Each warp starts at its own stage of its rows (its place, row / R or row / (R / 2) paired,
    // modulo the stages) and wraps around.
    // Started alike, the warps of a one-wave product all read the same part of their rows at once,
    // which made the speed depend on where the arena placed things, presumably by the way those
    // addresses fall on the memory's channels; rotated, it does not.
    int n_stages = (n_groups + stage_groups - 1) / stage_groups, rotation = (u32)row / (paired ? R / 2 : R) % (u32)n_stages;
    // s + rotation wraps at most once, so no division by the run-time n_stages is needed. The one
    // remainder left, and n_groups, are taken unsigned: no sign fix-ups.
    auto stage_first = [&](int s) {
        int k = s + rotation;
        return (k < n_stages ? k : k - n_stages) * stage_groups;
    };
    // The weights are read once a token, and 4.2 GB of them (8B) pass through a 50 MB L2: copied
    // as evict-first, they no longer push out the small tensors every kernel boundary waits on.
    // Every lane copies: a lane past a short stage's quants zero-fills its own piece (reading
    // nothing), and its metadata copy repeats the last piece (the same bytes into the same place),
    // so that no copy needs a branch. The cache policy is made in each copy's own asm
    // (copy_async16_read_once), which costs fewer instructions than one policy made once.
    // Q6_K's d, 4 bytes a super-block, is copied 4 bytes a lane in the same way.
    auto copy_stage = [&](int s) {
        int first = stage_first(s);
        int groups = min(stage_groups, n_groups - first), pieces = K::pieces * groups;
        int meta_last = min(lane, groups / 4 - 1), meta_shift = meta_last - lane;
        u32 to = staged_at + s % 2 * (R * row_pieces * 16);
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int k = 0; k < quant_pieces; k += 32)
                copy_async16_read_once(to + 16 * (r * row_pieces + k), quants[r] + K::pieces * first + k,
                                       lane + k < pieces);
            copy_async16_read_once(to + 16 * (r * row_pieces + quant_pieces + meta_shift),
                                   metas[r] + first / 4 + meta_shift, true);
            if (K::staged_d)
                copy_async4_read_once(staged_base + s % 2 * (R * row_pieces * 16) +
                                          16 * (r * row_pieces + quant_pieces + meta_pieces) + 4 * meta_last,
                                      ds[r] + first / 4 + meta_last);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // A group's activations from its first piece (the others `width` pieces apart) and its scales.
    auto group_at = [](const uint4* x, int width, float4 scales_sums) {
        return GroupActivations{x[0], x[width], x[2 * width], x[3 * width], scales_sums};
    };
    auto activations = [&](int g, int t, int width) {
        const uint4* x = (const uint4*)(xq + (u64)t * w.n_in) + unit_start(g, 4);
        return group_at(x, width, ((const float4*)(xd + (u64)t * (w.n_in / 16)))[g]);
    };
    // With one group a lane a stage (one token, two rows), a lane's activations are loaded before
    // it waits for the stage's quants, so that their trip overlaps the copy's; the residual is
    // loaded at the wait too (inputs_ready). Together they gain more than either alone.
    constexpr bool early = T == 1 && stage_groups == 32;
    // Where a lane's group lies in a stage's tiles of activations, found once: a stage starts at
    // a multiple of INTERLEAVE_UNITS groups, four pieces a group (unit_start).
    const uint4* x_lane = (const uint4*)xq + unit_start(lane, 4);
    const float4* scales_lane = (const float4*)xd + lane;
    for (int i = 0; i < R * T; i++) acc[i] = 0.0f;
    const typename K::Lane lane_groups(lane);
    // Where the kernel before reads little memory after its wait (one-token attention), a row pair
    // of two stages is copied whole before this one's: the second copy overlaps that kernel too.
    // Before kernels that read after their wait (the norms, and so Q, K and V), it slows them more
    // than it gains.
    bool whole = copy_whole && T == 1 && n_groups > stage_groups && n_groups <= 2 * stage_groups;
    copy_stage(0);
    if (whole) copy_stage(1);
    begin_after_inputs();
    inputs_ready();
    // The stages, compiled twice: where every tile is full (rows of a multiple of 512 values, as
    // every matrix of the 8B), a tile's width is a constant and the pieces' offsets immediates,
    // which saves instructions in every stage.
    auto stages = [&](auto full) {
        auto width_of = [&](int g) { return decltype(full)::value ? INTERLEAVE_UNITS : tile_width(g, n_groups); };
        for (int s = 0; s < n_stages; s++) {
            int first = stage_first(s);
            GroupActivations ahead;
            if (early && first + lane < n_groups)
                ahead = group_at(x_lane + 4 * first, width_of(first + lane), scales_lane[first]);
            if (whole && s == 0) {
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            } else if (s + 1 < n_stages) {
                copy_stage(s + 1);
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            } else {
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            }
            __syncwarp();
#pragma unroll 1
            for (int k = 0; k < stage_groups; k += 32) {
                int g = first + lane + k;
                if (g >= n_groups) break;
                int width = width_of(g);
                // Unrolled so that acc is indexed by constants: left a loop (Q6_K's larger group
                // body), acc went to local memory.
#pragma unroll
                for (int t = 0; t < T; t++) {
                    GroupActivations a = early ? ahead : activations(g, t, width);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const uint4* staged = stage[warp][s % 2][r];
                        int sb = (g - first) / 4;
                        float d = K::staged_d ? ((const float*)(staged + quant_pieces + meta_pieces))[sb] : 0.0f;
                        acc[r * T + t] += lane_groups.dot(staged + unit_start(g - first, K::pieces), width,
                                                          staged + quant_pieces + sb, d, a);
                    }
                }
            }
            __syncwarp();  // every lane is done with this stage before it is copied over
        }
    };
    if (n_groups % INTERLEAVE_UNITS == 0)
        stages(Constant<true>{});
    else
        stages(Constant<false>{});
}

#define GEMV_INT(NAME, TY, T, GLU, KIND)                                                                       \
    extern "C" __global__ void KIND##_##NAME##_##T(GemvIntParams p) {                                          \
        const Matrices& mats = p.mats;                                                                         \
        int n_in = p.n_in;                                                                                     \
        const i8* xq = p.xq;                                                                                   \
        const float* xd = p.xd;                                                                                \
        if (!ReadsBeforeWait<TY>::value) begin_after_inputs();                                                 \
        if (T == 1 && ReadsBeforeWait<TY>::value) start_dependents();                                          \
        gemv_rows<TY, T, GLU, RowsPerWarp<TY, T>::value>(mats, n_in, [&](const Weight& w, const Weight& up, int row, \
                                                                           int n_rows, float* acc, auto ready) { \
            int_row<TY, T, GLU>(w, up, row, n_rows, xq, xd, acc, ready, mats.copy_whole);                        \
        });                                                                                                    \
    }
#define GEMV_INT_ALL(NAME, TY)                                                                                  \
    GEMV_INT(NAME, TY, 1, false, gemv_int) GEMV_INT(NAME, TY, 2, false, gemv_int) GEMV_INT(NAME, TY, 4, false, gemv_int) \
    GEMV_INT(NAME, TY, 8, false, gemv_int) GEMV_INT(NAME, TY, 1, true, gemv_int_glu) GEMV_INT(NAME, TY, 2, true, gemv_int_glu) \
    GEMV_INT(NAME, TY, 4, true, gemv_int_glu) GEMV_INT(NAME, TY, 8, true, gemv_int_glu)
GEMV_INT_ALL(q8_0, TY_Q8_0)
GEMV_INT_ALL(q4_0, TY_Q4_0)
GEMV_INT_ALL(q4_1, TY_Q4_1)
GEMV_INT_ALL(q5_0, TY_Q5_0)
GEMV_INT_ALL(q4_k, TY_Q4_K)
GEMV_INT_ALL(q6_k, TY_Q6_K)

// Float and FP8 weights: lane-interleaved 16-byte loads, so each warp load is 512 contiguous
// bytes, with UNROLL loads in flight per lane before the first is used; activations read as
// float4, by plain loads (not __ldg), since the normed kernels below pass a copy in shared memory.
// (Plain loads also keep the one-token bf16 kernel under its register bound without a spill.)
// FP8's 16 codes a load lie in one 32-value chunk: their dot product is scaled once, by the
// chunk's scale.
template <int TY> struct ValueBytes { static const int value = TY == TY_F32 ? 4 : TY == TY_FP8 ? 1 : 2; };

// Values 4k..4k+3 of a 16-byte load as floats.
template <int TY>
__device__ __forceinline__ void widen4(uint4 raw, int k, float* y) {
    u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    if (TY == TY_F32) {
        for (int j = 0; j < 4; j++) y[j] = __uint_as_float(words[j]);
    } else if (TY == TY_FP8) {
        fp8x4_to_f32(words[k], y);
    } else {
        for (int j = 0; j < 2; j++) {
            u32 v = words[2 * k + j];
            y[2 * j] = TY == TY_BF16 ? __uint_as_float(v << 16) : f16_to_f32((u16)(v & 0xffff));
            y[2 * j + 1] = TY == TY_BF16 ? __uint_as_float(v & 0xffff0000u) : f16_to_f32((u16)(v >> 16));
        }
    }
}

// One load's values (at..at + 16 / ValueBytes of the row) dotted with T tokens' activations into acc.
template <int TY, int T>
__device__ __forceinline__ void dot_load(uint4 raw, const float* x, int n_in, int at, const Fp8Scales& scales, float* acc) {
    constexpr int PER = 16 / ValueBytes<TY>::value;
    float sums[T];
    for (int t = 0; t < T; t++) sums[t] = TY == TY_FP8 ? 0.0f : acc[t];
    for (int k = 0; k < PER / 4; k++) {
        float y[4];
        widen4<TY>(raw, k, y);
        for (int t = 0; t < T; t++) {
            float4 v = *(const float4*)(x + (u64)t * n_in + at + 4 * k);
            sums[t] += y[0] * v.x + y[1] * v.y + y[2] * v.z + y[3] * v.w;
        }
    }
    if (TY == TY_FP8) {
        float scale = fp8_scale(scales, at / 32);
        for (int t = 0; t < T; t++) acc[t] = fmaf(scale, sums[t], acc[t]);
    } else {
        for (int t = 0; t < T; t++) acc[t] = sums[t];
    }
}

template <int TY, int T>
__device__ __forceinline__ void float_row(const Weight& w, int row, const float* x, float* acc) {
    int n_in = w.n_in;
    constexpr int PER = 16 / ValueBytes<TY>::value;  // values per 16-byte load
    constexpr int UNROLL = 4;
    const uint4* wrow = (const uint4*)(w.q + (u64)row * n_in * ValueBytes<TY>::value);
    Fp8Scales scales{};
    if constexpr (TY == TY_FP8) scales = fp8_scales(w, row);
    int n_loads = n_in / PER;
    for (int t = 0; t < T; t++) acc[t] = 0.0f;
    int i = threadIdx.x % 32;
    for (; i + 32 * (UNROLL - 1) < n_loads; i += 32 * UNROLL) {
        // Unrolled by hand: left to itself, FP8's eight-token kernel indexed `raw` in local memory.
        uint4 raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) raw[u] = load_stream(wrow + i + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) dot_load<TY, T>(raw[u], x, n_in, (i + 32 * u) * PER, scales, acc);
    }
    for (; i < n_loads; i += 32) dot_load<TY, T>(load_stream(wrow + i), x, n_in, i * PER, scales, acc);
}

// The one-token kernels are held to 40 registers, six blocks (48 warps) per multiprocessor instead
// of five, to keep more loads in flight; a tighter bound spills.
#define GEMV(NAME, TY, ROW, T, GLU, KIND)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, T == 1 ? 6 : 1)                                          \
        KIND##_##NAME##_##T(GemvParams p) {                                                                    \
        const Matrices& mats = p.mats;                                                                         \
        int n_in = p.n_in;                                                                                     \
        const float* x = p.x;                                                                                  \
        begin_after_inputs();                                                                                  \
        gemv_rows<TY, T, GLU, 1>(mats, n_in, [&](const Weight& w, const Weight&, int row, int, float* acc, auto ready) {      \
            ready();                                                                                           \
            ROW<TY, T>(w, row, x, acc);                                                                        \
        });                                                                                                    \
    }
#define GEMV_EACH(NAME, TY, ROW)                                                                                \
    GEMV(NAME, TY, ROW, 1, false, gemv) GEMV(NAME, TY, ROW, 2, false, gemv) GEMV(NAME, TY, ROW, 4, false, gemv)  \
    GEMV(NAME, TY, ROW, 8, false, gemv) GEMV(NAME, TY, ROW, 1, true, gemv_glu) GEMV(NAME, TY, ROW, 2, true, gemv_glu) \
    GEMV(NAME, TY, ROW, 4, true, gemv_glu) GEMV(NAME, TY, ROW, 8, true, gemv_glu)

// The one-token f32-activation kernels with the RMSNorm of their input folded in: each block
// normalizes its own copy of the row (n_in a multiple of 4, at most NORMED_MAX_IN) into shared
// memory, and its warps read it from there. That costs less than a launch of its own and a trip
// of the row through memory. (Normalizing in each warp as it reads, instead, would load the
// norm's weight once per weight load.) The kernel's wait is
// here: a thread's first four values of the norm's weight, which no kernel writes, are loaded
// before it, so a small model's rows (up to 1024 values) need no second trip from memory.
#define NORMED_MAX_IN 8192
__device__ __forceinline__ void normalize_row(float* xs, const float* x, const float* norm, int n, float eps) {
    int first = 4 * threadIdx.x;
    float4 g_first = first < n ? *(const float4*)(norm + first) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    begin_after_inputs();
    float sum = 0.0f;
    for (int i = first; i < n; i += 4 * blockDim.x) {
        float4 v = *(const float4*)(x + i);
        *(float4*)(xs + i) = v;
        sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    float scale = rsqrtf(block_sum(sum) / n + eps);
    for (int i = first; i < n; i += 4 * blockDim.x) {  // the values this thread stored
        float4 g = i == first ? g_first : *(const float4*)(norm + i);
        xs[i] *= scale * g.x, xs[i + 1] *= scale * g.y, xs[i + 2] *= scale * g.z, xs[i + 3] *= scale * g.w;
    }
    __syncthreads();
}

#define GEMV_NORMED(NAME, TY, ROW, GLU, KIND)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 6)                                                        \
        KIND##_normed_##NAME(GemvNormedParams p) {                                                             \
        const Matrices& mats = p.mats;                                                                         \
        int n_in = p.n_in;                                                                                     \
        __shared__ __align__(16) float xs[NORMED_MAX_IN];                                                      \
        normalize_row(xs, p.x, p.norm, n_in, p.eps);                                                           \
        gemv_rows<TY, 1, GLU, 1>(mats, n_in, [&](const Weight& w, const Weight&, int row, int, float* acc, auto ready) {      \
            ready();                                                                                           \
            ROW<TY, 1>(w, row, xs, acc);                                                                       \
        });                                                                                                    \
    }
#define GEMV_ALL(NAME, TY, ROW) GEMV_EACH(NAME, TY, ROW) GEMV_NORMED(NAME, TY, ROW, false, gemv) GEMV_NORMED(NAME, TY, ROW, true, gemv_glu)
GEMV_ALL(f32, TY_F32, float_row)
GEMV_ALL(f16, TY_F16, float_row)
GEMV_ALL(bf16, TY_BF16, float_row)
GEMV_ALL(fp8, TY_FP8, float_row)
GEMV_ALL(q8_0, TY_Q8_0, quant_row)
GEMV_ALL(q4_0, TY_Q4_0, quant_row)
GEMV_ALL(q4_1, TY_Q4_1, quant_row)
GEMV_ALL(q5_0, TY_Q5_0, quant_row)
GEMV_ALL(q4_k, TY_Q4_K, quant_row)
GEMV_ALL(q6_k, TY_Q6_K, quant_row)

// FP8 weights for a few tokens on the tensor cores (under Fastest: `Paths::fp8_tensor_cores`):
// converting a code to f32 and multiplying costs about five instructions a byte on the f32 kernels
// above, which holds a step's weights under their byte limit; here a code costs under one. A block
// of eight warps takes 16 rows (with GLU 8 of gate and the same 8 of up) and the warps take the
// rows' 32-value chunks in turn. Each lane holds 8 codes of a chunk for rows g and g + 8 (lane
// 4g + t, codes 8t..8t + 7), the tokens' activations for the same codes rounded to f16 (lane 4g + t
// those of token g), so two m16n8k16 MMAs sum a chunk for all 16 rows and 8 tokens; the chunk's
// scales then multiply those sums in f32, as the reference does. The warps' sums meet in shared
// memory.
#define FP8_MMA_ROWS 16

// Two E4M3 codes (the low and high bytes of `pair`) as an f16x2, exactly: on sm_89 and later by the
// conversion instruction; before, by moving each code's bits to their f16 places, which leaves its
// value 2^8 too small (FP8_F16_UNSCALE puts it back).
#if __CUDA_ARCH__ >= 890
#define FP8_F16_UNSCALE 1.0f
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 h;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(h) : "r"(pair));
    return h;
}
#else
#define FP8_F16_UNSCALE 256.0f
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 placed = __byte_perm(pair, 0, 0x1404);  // code 0 at bits 8-15, code 1 at bits 24-31
    return (placed & 0x80008000u) | ((placed >> 1) & 0x3f803f80u);
}
#endif

// Two f32 as an f16x2 (lo in the low half), round to nearest.
__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {
    u32 h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
    return h;
}

// d = a b (m16n8k16, f16 inputs, f32 sums), from zero.
__device__ __forceinline__ void mma_f16_fresh(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// 8 bytes of weights read once (see load_stream).
__device__ __forceinline__ uint2 load_stream8(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// The block's 16 rows times T tokens from activations x (T rows of n_in, global or shared memory):
// written to out or added to it (mats.accumulate), or with GLU silu(gate) * up of 8 rows. `ready`
// is the PDL wait (or the norm that waits): the first chunks' weights are read before it.
template <int T, bool GLU, typename Ready>
__device__ __forceinline__ void fp8_mma_tile(const Matrices& mats, int n_in, const float* x, Ready ready) {
    __shared__ float sums[8][32][4];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    Weight wa, wb;
    float* out = mats.out[0];
    int n_out = mats.n_out[0], first = 0, ra, rb;
    if constexpr (GLU) {
        wa = Weight{mats.q[0], mats.s[0], mats.m[0], n_in}, wb = Weight{mats.q[1], mats.s[1], mats.m[1], n_in};
        first = blockIdx.x * 8;
        ra = rb = min(first + g, n_out - 1);
    } else {
        // Tiles never straddle matrices; the loop is unrolled so that the parameters are indexed
        // by constants (see pick_row).
        int k = blockIdx.x, which = 0;
#pragma unroll
        for (int i = 0; i < MAX_MATRICES; i++) {
            int tiles = (mats.n_out[i] + FP8_MMA_ROWS - 1) / FP8_MMA_ROWS;
            if (i < mats.count && k >= 0 && k < tiles) which = i, first = k * FP8_MMA_ROWS;
            if (i < mats.count && k >= 0) k -= tiles;
        }
#pragma unroll
        for (int i = 0; i < MAX_MATRICES; i++)
            if (i == which) wa = Weight{mats.q[i], mats.s[i], mats.m[i], n_in}, out = mats.out[i], n_out = mats.n_out[i];
        wb = wa;
        ra = min(first + g, n_out - 1), rb = min(first + g + 8, n_out - 1);
    }
    const uint2* qa = (const uint2*)(wa.q + (u64)ra * n_in) + t;
    const uint2* qb = (const uint2*)(wb.q + (u64)rb * n_in) + t;
    Fp8Scales sa = fp8_scales(wa, ra), sb = fp8_scales(wb, rb);
    int n_chunks = n_in / 32;
    constexpr int U = 4;  // chunks a warp has in flight
    uint2 ca[U], cb[U];
    auto load = [&](int c0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 8 * u;
            ca[u] = c < n_chunks ? load_stream8(qa + 4 * c) : make_uint2(0, 0);
            cb[u] = c < n_chunks ? load_stream8(qb + 4 * c) : make_uint2(0, 0);
        }
    };
    float total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    load(warp);
    ready();
    for (int c0 = warp; c0 < n_chunks; c0 += 8 * U) {
        if (c0 != warp) load(c0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 8 * u;
            if (c >= n_chunks) break;
            u32 b[4] = {0, 0, 0, 0};
            if (g < T) {
                const float4* xv = (const float4*)(x + (u64)g * n_in + 32 * c + 8 * t);
                float4 lo = xv[0], hi = xv[1];
                b[0] = f16x2_of(lo.x, lo.y), b[1] = f16x2_of(lo.z, lo.w);
                b[2] = f16x2_of(hi.x, hi.y), b[3] = f16x2_of(hi.z, hi.w);
            }
            // Codes 4m..4m + 3 of each row make MMA m's depths 2t, 2t + 1, 2t + 8, 2t + 9, as the
            // activations in b[2m], b[2m + 1] do.
            u32 words_a[2] = {ca[u].x, ca[u].y}, words_b[2] = {cb[u].x, cb[u].y};
            float d[4], e[4];
            for (int m = 0; m < 2; m++) {
                u32 a[4] = {e4m3x2_to_f16x2(words_a[m]), e4m3x2_to_f16x2(words_b[m]),
                            e4m3x2_to_f16x2(words_a[m] >> 16), e4m3x2_to_f16x2(words_b[m] >> 16)};
                mma_f16_fresh(m == 0 ? d : e, a, b[2 * m], b[2 * m + 1]);
            }
            float scale_a = fp8_scale(sa, c), scale_b = fp8_scale(sb, c);
            total[0] = fmaf(scale_a, d[0] + e[0], total[0]);
            total[1] = fmaf(scale_a, d[1] + e[1], total[1]);
            total[2] = fmaf(scale_b, d[2] + e[2], total[2]);
            total[3] = fmaf(scale_b, d[3] + e[3], total[3]);
        }
    }
    // Lane 4g + t holds rows g (0, 1) and g + 8 (2, 3) for tokens 2t and 2t + 1.
    for (int j = 0; j < 4; j++) sums[warp][lane][j] = total[j] * FP8_F16_UNSCALE;
    __syncthreads();
    int i = threadIdx.x, token = i % 8, r = i / 8;
    auto summed = [&](int row, int tok) {
        float s = 0.0f;
        for (int w = 0; w < 8; w++) s += sums[w][4 * (row % 8) + tok / 2][2 * (row / 8) + tok % 2];
        return s;
    };
    if (token >= T) return;
    if constexpr (GLU) {
        if (r < 8 && first + r < n_out) {
            float gate = summed(r, token), up = summed(r + 8, token);
            out[(u64)token * n_out + first + r] = __fdividef(gate, 1.0f + __expf(-gate)) * up;
        }
    } else if (r < FP8_MMA_ROWS && first + r < n_out) {
        float* o = out + (u64)token * n_out + first + r;
        float s = summed(r, token);
        *o = mats.accumulate ? *o + s : s;
    }
}

#define GEMV_FP8_MMA(T, GLU, KIND)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) KIND##_mma_fp8_##T(GemvParams p) {                \
        fp8_mma_tile<T, GLU>(p.mats, p.n_in, p.x, [] { begin_after_inputs(); });                         \
    }
#define GEMV_FP8_MMA_NORMED(GLU, KIND)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) KIND##_normed_mma_fp8(GemvNormedParams p) {       \
        __shared__ __align__(16) float xs[NORMED_MAX_IN];                                               \
        fp8_mma_tile<1, GLU>(p.mats, p.n_in, xs, [&] { normalize_row(xs, p.x, p.norm, p.n_in, p.eps); }); \
    }
GEMV_FP8_MMA(1, false, gemv) GEMV_FP8_MMA(2, false, gemv) GEMV_FP8_MMA(4, false, gemv) GEMV_FP8_MMA(8, false, gemv)
GEMV_FP8_MMA(1, true, gemv_glu) GEMV_FP8_MMA(2, true, gemv_glu) GEMV_FP8_MMA(4, true, gemv_glu) GEMV_FP8_MMA(8, true, gemv_glu)
GEMV_FP8_MMA_NORMED(false, gemv) GEMV_FP8_MMA_NORMED(true, gemv_glu)

// Sixteen values as f16 in two 16-byte stores (p is 32-byte aligned: a run starts at a multiple
// of 16 values of a row of a multiple of 32).
__device__ __forceinline__ void store_f16x16(u16* p, const float* y) {
    u32 words[8];
    for (int k = 0; k < 8; k++) words[k] = (u32)f32_to_f16(y[2 * k]) | ((u32)f32_to_f16(y[2 * k + 1]) << 16);
    ((uint4*)p)[0] = make_uint4(words[0], words[1], words[2], words[3]);
    ((uint4*)p)[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

// Whole-matrix dequantization to f16, for prefill through cuBLAS: one thread per 32-value chunk,
// each run of 16 stored in two 16-byte stores: stored value by value, the writes were a small
// fraction of the memory's bandwidth and held prefill back.
template <int TY>
__device__ void dequant_f16(Weight w, u16* out, int n_out) {
    begin_after_inputs();
    u64 chunks = (u64)n_out * (w.n_in / 32);
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < chunks; g += (u64)gridDim.x * blockDim.x) {
        u64 row = g / (w.n_in / 32);
        int at0, at1;
        float y[32];
        chunk<TY>(w, row, (int)(g % (w.n_in / 32)), y, &at0, &at1);
        u16* o = out + row * w.n_in;
        store_f16x16(o + at0, y);
        store_f16x16(o + at1, y + 16);
    }
}

#define DEQUANT(NAME, TY) \
    extern "C" __global__ void dequant_f16_##NAME(DequantParams p) { \
        dequant_f16<TY>(Weight{p.q, p.s, p.m, p.n_in}, p.out, p.n_out); \
    }
DEQUANT(q8_0, TY_Q8_0)
DEQUANT(q4_0, TY_Q4_0)
DEQUANT(q4_1, TY_Q4_1)
DEQUANT(q5_0, TY_Q5_0)
DEQUANT(q4_k, TY_Q4_K)
DEQUANT(q6_k, TY_Q6_K)
DEQUANT(fp8, TY_FP8)
