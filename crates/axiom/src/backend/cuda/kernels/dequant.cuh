// Quantized weights on the GPU are stored split by field, so that every load is wide, aligned and
// coalesced (see `SplitWeight` in cuda/weights.rs): the quants of a row are contiguous (`q`; Q4_K's
// and Q6_K's interleaved, common.cuh), and the per-block scales, minimums or packed K-quant metadata sit in
// side arrays (`s`, `m`). A row of n values is decoded as n/32 chunks; chunk c yields 32 values in
// two runs of 16, starting at `at0` and `at1` within the row. Values are exactly the reference
// dequantization's.

struct Weight {
    const u8* q;  // quants, row-major
    const u8* s;  // per-block scales (f16), or K-quant metadata
    const u8* m;  // per-block minimums (f16, Q4_1) or fifth bits (u32, Q5_0), or Q6_K's d (f32)
    int n_in;
};

// A chunk as small integers, as the integer kernels use it: two runs of 16 values, run r at
// positions at[r] of the row, value j of run r = scale[r] * q + offset[r], where q is byte j % 4 of
// word q[4r + j / 4] read as a signed int8. `chunk` expands it to floats, exactly as the reference
// dequantization computes them.
struct IntChunk {
    u32 q[8];
    float scale[2];
    float offset[2];
    int at[2];
};

// Four bytes of 0..15 (0..63) to the signed bytes q - 8 (q - 32).
__device__ __forceinline__ u32 nibbles_minus_8(u32 x) { return (x & 0x07070707u) | ((~x & 0x08080808u) * 0x1f); }
__device__ __forceinline__ u32 six_bits_minus_32(u32 x) { return (x & 0x1f1f1f1fu) | ((~x & 0x20202020u) * 7); }
// Four bytes of 0..31 to the signed bytes q - 16.
__device__ __forceinline__ u32 five_bits_minus_16(u32 x) { return (x & 0x0f0f0f0fu) | ((~x & 0x10101010u) * 0x0f); }
// Bits 0-3 of h to bit 4 of bytes 0-3: the multiply lays four copies of h 7 bits apart, so copy j
// puts bit j at 8j (no carries: the copies do not overlap).
__device__ __forceinline__ u32 fifth_bits(u32 h) { return (((h & 15) * 0x00204081u) << 4) & 0x10101010u; }

// The scale and minimum of sub-block j of a Q4_K super-block whose 16 bytes of metadata are `meta`:
// d and dmin (f16) in x, then 12 bytes of 6-bit scales and minimums in y, z, w, those of
// sub-blocks 0-3 in the low six bits of y's (scales) and z's (minimums) bytes, those of 4-7 in w's
// nibbles with their top two bits in the top bits of y's and z's bytes.
__device__ __forceinline__ void q4k_scale_min(uint4 meta, int j, float* scale, float* min) {
    int shift = 8 * (j % 4);
    u32 lo = meta.y >> shift, mid = meta.z >> shift, hi = meta.w >> shift;
    u32 sc = j < 4 ? lo & 63 : (hi & 15) | (lo >> 6 & 3) << 4;
    u32 m = j < 4 ? mid & 63 : (hi >> 4 & 15) | (mid >> 6 & 3) << 4;
    *scale = f16_to_f32((u16)meta.x) * (float)sc;
    *min = f16_to_f32((u16)(meta.x >> 16)) * (float)m;
}

__device__ __forceinline__ void words(uint4 raw, u32* w) {
    w[0] = raw.x;
    w[1] = raw.y;
    w[2] = raw.z;
    w[3] = raw.w;
}

// 16 bytes of nibbles as two runs: the low nibbles (q[0..4]), then the high ones (q[4..8]).
__device__ __forceinline__ void split_nibbles(uint4 raw, u32* q) {
    u32 w[4];
    words(raw, w);
    for (int i = 0; i < 4; i++) {
        q[i] = w[i] & 0x0f0f0f0fu;
        q[4 + i] = (w[i] >> 4) & 0x0f0f0f0fu;
    }
}

template <int TY> __device__ __forceinline__ IntChunk int_chunk(const Weight& w, u64 row, int c);

template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q8_0>(const Weight& w, u64 row, int c) {
    const uint4* q = (const uint4*)(w.q + row * w.n_in + 32 * c);
    float d = f16_to_f32(((const u16*)w.s)[row * (w.n_in / 32) + c]);
    IntChunk k = {{}, {d, d}, {0.0f, 0.0f}, {32 * c, 32 * c + 16}};
    words(q[0], k.q);
    words(q[1], k.q + 4);
    return k;
}

// Q4_0 and Q4_1: 16 bytes of nibbles, value j the low nibble of byte j and j + 16 the high one.
template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q4_0>(const Weight& w, u64 row, int c) {
    float d = f16_to_f32(((const u16*)w.s)[row * (w.n_in / 32) + c]);
    IntChunk k = {{}, {d, d}, {0.0f, 0.0f}, {32 * c, 32 * c + 16}};
    split_nibbles(*(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c), k.q);
    for (int i = 0; i < 8; i++) k.q[i] = nibbles_minus_8(k.q[i]);
    return k;
}

template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q4_1>(const Weight& w, u64 row, int c) {
    u64 b = row * (w.n_in / 32) + c;
    float d = f16_to_f32(((const u16*)w.s)[b]), m = f16_to_f32(((const u16*)w.m)[b]);
    IntChunk k = {{}, {d, d}, {m, m}, {32 * c, 32 * c + 16}};
    split_nibbles(*(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c), k.q);
    return k;
}

// Q5_0: Q4_0's nibbles, each with a fifth bit, bit j of the block's word in `m` for value j.
template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q5_0>(const Weight& w, u64 row, int c) {
    u64 b = row * (w.n_in / 32) + c;
    float d = f16_to_f32(((const u16*)w.s)[b]);
    u32 high = ((const u32*)w.m)[b];
    IntChunk k = {{}, {d, d}, {0.0f, 0.0f}, {32 * c, 32 * c + 16}};
    split_nibbles(*(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c), k.q);
    for (int i = 0; i < 8; i++) k.q[i] = five_bits_minus_16(k.q[i] | fifth_bits(high >> (4 * i)));
    return k;
}

// Q4_K: chunk c is 16 bytes of a super-block's 128 quant bytes; the 32-byte group g = (c%8)/2
// holds sub-blocks 2g (low nibbles) and 2g+1 (high), and this chunk is their half h = c%2, piece
// h of the row's group c/2 in the interleaved layout (common.cuh). Metadata per super-block: d,
// dmin (f16) and the 12 bytes of packed 6-bit scales and mins.
template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q4_K>(const Weight& w, u64 row, int c) {
    int sb = c / 8, g = (c % 8) / 2, h = c % 2;
    uint4 meta = ((const uint4*)w.s)[row * (w.n_in / 256) + sb];
    float scale0, min0, scale1, min1;
    q4k_scale_min(meta, 2 * g, &scale0, &min0);
    q4k_scale_min(meta, 2 * g + 1, &scale1, &min1);
    int at0 = 256 * sb + 64 * g + 16 * h;
    IntChunk k = {{}, {scale0, scale1}, {-min0, -min1}, {at0, at0 + 32}};
    int group = c / 2, n_groups = w.n_in / 64;
    const uint4* q = (const uint4*)(w.q + row * (w.n_in / 2));
    split_nibbles(q[unit_start(group, 2) + h * tile_width(group, n_groups)], k.q);
    return k;
}

// Q6_K, interleaved in 48-byte groups of 64 values (common.cuh; `q6k_group` in cuda/weights.rs):
// byte i of a group's piece k holds value 16k + i in its low six bits (the quant plus 32) and bits
// 2k, 2k + 1 of value 48 + i in its top two. Per super-block, 16 signed scales (one a run of 16)
// in `s` and d as f32 in `m`.
__device__ __forceinline__ u32 q6k_low(u32 piece_word) { return piece_word & 0x3f3f3f3fu; }
// Values 48 + 4i .. 51 + 4i from word i of the three pieces.
__device__ __forceinline__ u32 q6k_top(u32 a, u32 b, u32 c) {
    return ((a >> 6) & 0x03030303u) | ((b >> 4) & 0x0c0c0c0cu) | ((c >> 2) & 0x30303030u);
}

// Chunk c is half c % 2 of group c / 2: values 0-31 (pieces 0 and 1) or 32-63 (piece 2 and the
// top bits).
template <> __device__ __forceinline__ IntChunk int_chunk<TY_Q6_K>(const Weight& w, u64 row, int c) {
    int group = c / 2, h = c % 2, n_groups = w.n_in / 64, width = tile_width(group, n_groups);
    u64 sb = row * (w.n_in / 256) + group / 4;
    float d = ((const float*)w.m)[sb];
    const i8* scales = (const i8*)w.s + 16 * sb + 4 * (group % 4) + 2 * h;
    int at0 = 64 * group + 32 * h;
    IntChunk k = {{}, {d * (float)scales[0], d * (float)scales[1]}, {0.0f, 0.0f}, {at0, at0 + 16}};
    const uint4* q = (const uint4*)(w.q + row * (w.n_in / 4 * 3)) + unit_start(group, 3);
    u32 p0[4], p1[4], p2[4];
    words(q[0], p0);
    words(q[width], p1);
    words(q[2 * width], p2);
    for (int i = 0; i < 4; i++) {
        k.q[i] = six_bits_minus_32(q6k_low(h == 0 ? p0[i] : p2[i]));
        k.q[4 + i] = six_bits_minus_32(h == 0 ? q6k_low(p1[i]) : q6k_top(p0[i], p1[i], p2[i]));
    }
    return k;
}

template <int TY> __device__ __forceinline__ void chunk(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    IntChunk k = int_chunk<TY>(w, row, c);
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 16; j++) {
            int q = (i8)((k.q[4 * r + j / 4] >> (8 * (j % 4))) & 0xff);
            y[16 * r + j] = k.scale[r] * (float)q + k.offset[r];
        }
    *at0 = k.at[0];
    *at1 = k.at[1];
}

// Float weights, 32 values per chunk, stored as they are.
template <int TY> __device__ __forceinline__ void float_chunk(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    const u8* p = w.q + (row * w.n_in + 32 * c) * (TY == TY_F32 ? 4 : 2);
    for (int j = 0; j < (TY == TY_F32 ? 8 : 4); j++) {
        uint4 raw = ((const uint4*)p)[j];
        u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
        for (int k = 0; k < 4; k++) {
            if (TY == TY_F32) {
                y[4 * j + k] = __uint_as_float(words[k]);
            } else {
                y[8 * j + 2 * k] = TY == TY_BF16 ? __uint_as_float(words[k] << 16) : f16_to_f32((u16)(words[k] & 0xffff));
                y[8 * j + 2 * k + 1] = TY == TY_BF16 ? __uint_as_float(words[k] & 0xffff0000u) : f16_to_f32((u16)(words[k] >> 16));
            }
        }
    }
    *at0 = 32 * c;
    *at1 = 32 * c + 16;
}
template <> __device__ __forceinline__ void chunk<TY_F32>(const Weight& w, u64 r, int c, float* y, int* a, int* b) { float_chunk<TY_F32>(w, r, c, y, a, b); }
template <> __device__ __forceinline__ void chunk<TY_F16>(const Weight& w, u64 r, int c, float* y, int* a, int* b) { float_chunk<TY_F16>(w, r, c, y, a, b); }
template <> __device__ __forceinline__ void chunk<TY_BF16>(const Weight& w, u64 r, int c, float* y, int* a, int* b) { float_chunk<TY_BF16>(w, r, c, y, a, b); }

// FP8 (E4M3) weights: a row's codes contiguous, a byte each (`q`), and their scales in a compact
// table (`s`, written by `Fp8ScaleGrid::kernel_table` in cuda/weights.rs): a 16-byte header of u32s (row
// shift, chunk shift, scales a row of the table), then f32 scales (NaN for a block with a NaN code). The scale of row r's 32-value
// chunk c is scale[(r >> row shift) * per row + (c >> chunk shift)]: one per square block,
// per row, per matrix or per chunk, whichever the checkpoint's scales have.
struct Fp8Scales {
    const float* row;  // this row's scales in the table
    int chunk_shift;
};

__device__ __forceinline__ Fp8Scales fp8_scales(const Weight& w, u64 row) {
    uint4 h = __ldg((const uint4*)w.s);
    return Fp8Scales{(const float*)w.s + 4 + (row >> h.x) * h.z, (int)h.y};
}

__device__ __forceinline__ float fp8_scale(const Fp8Scales& s, int c) { return __ldg(s.row + (c >> s.chunk_shift)); }

// Four E4M3 codes (byte j of `codes` is value j) to floats, exactly, on the integer and f32 pipes
// rather than through f16 conversions, whose unit has a fraction of their throughput: a code's
// sign, exponent and mantissa moved to their f32 places make an f32 2^120 times too small (a
// subnormal code a subnormal f32; the kernels do not flush those), which one multiply corrects.
// The NaN codes (S.1111.111) land on 480: their blocks' scales are NaN instead (Fp8ScaleGrid in
// cuda/weights.rs), which leaves NaN whatever the block enters.
__device__ __forceinline__ void fp8x4_to_f32(u32 codes, float* y) {
    const float two_120 = __int_as_float(0x7b800000);
    for (int j = 0; j < 4; j++) {
        u32 c = codes << (24 - 8 * j);  // code j in the top byte
        y[j] = __uint_as_float((c & 0x80000000u) | ((c >> 4) & 0x07f00000u)) * two_120;
    }
}

// 32 values of a chunk, each its code's value times the chunk's scale: one rounding, as the
// reference dequantization.
template <> __device__ __forceinline__ void chunk<TY_FP8>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    const uint4* q = (const uint4*)(w.q + row * w.n_in + 32 * c);
    float scale = fp8_scale(fp8_scales(w, row), c);
    for (int j = 0; j < 2; j++) {
        u32 codes[4];
        words(q[j], codes);
        for (int k = 0; k < 4; k++) fp8x4_to_f32(codes[k], y + 16 * j + 4 * k);
    }
    for (int j = 0; j < 32; j++) y[j] *= scale;
    *at0 = 32 * c;
    *at1 = 32 * c + 16;
}
