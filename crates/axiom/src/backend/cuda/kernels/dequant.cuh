// Quantized weights on the GPU are stored split by field, so that every load is wide, aligned and
// coalesced (see `SplitWeight` in cuda/mod.rs): the quants of a row are contiguous (`q`), and the
// per-block scales, minimums or packed K-quant metadata sit in side arrays (`s`, `m`). A row of
// n values is decoded as n/32 chunks; chunk c yields 32 values in two runs of 16, starting at
// `at0` and `at1` within the row. Values are exactly the reference dequantization's.

struct Weight {
    const u8* q;  // quants, row-major
    const u8* s;  // per-block scales (f16), or K-quant metadata
    const u8* m;  // per-block minimums (f16, Q4_1), or Q6_K's high bits
    int n_in;
};

__device__ __forceinline__ void nibbles(uint4 raw, float d, float offset, float* y) {
    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 4; b++) {
            u32 byte = (w[k] >> (8 * b)) & 0xff;
            y[4 * k + b] = d * (float)(byte & 15) + offset;
            y[16 + 4 * k + b] = d * (float)(byte >> 4) + offset;
        }
}

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int TY> __device__ __forceinline__ void chunk(const Weight& w, u64 row, int c, float* y, int* at0, int* at1);

template <> __device__ __forceinline__ void chunk<TY_Q8_0>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    const uint4* q = (const uint4*)(w.q + row * w.n_in + 32 * c);
    float d = f16_to_f32(((const u16*)w.s)[row * (w.n_in / 32) + c]);
    uint4 raw[2] = {q[0], q[1]};
    for (int h = 0; h < 2; h++) {
        u32 words[4] = {raw[h].x, raw[h].y, raw[h].z, raw[h].w};
        for (int k = 0; k < 4; k++)
            for (int b = 0; b < 4; b++) y[16 * h + 4 * k + b] = d * (float)(i8)((words[k] >> (8 * b)) & 0xff);
    }
    *at0 = 32 * c;
    *at1 = 32 * c + 16;
}

template <> __device__ __forceinline__ void chunk<TY_Q4_0>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    float d = f16_to_f32(((const u16*)w.s)[row * (w.n_in / 32) + c]);
    nibbles(*(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c), d, -8.0f * d, y);
    *at0 = 32 * c;
    *at1 = 32 * c + 16;
}

template <> __device__ __forceinline__ void chunk<TY_Q4_1>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    u64 b = row * (w.n_in / 32) + c;
    float d = f16_to_f32(((const u16*)w.s)[b]), m = f16_to_f32(((const u16*)w.m)[b]);
    nibbles(*(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c), d, m, y);
    *at0 = 32 * c;
    *at1 = 32 * c + 16;
}

// Q4_K: chunk c is 16 bytes of a super-block's 128 quant bytes; the 32-byte group g = (c%8)/2
// holds sub-blocks 2g (low nibbles) and 2g+1 (high), and this chunk is their half h = c%2.
// Metadata per super-block: d, dmin (f16) and the 12 bytes of packed 6-bit scales and mins.
template <> __device__ __forceinline__ void chunk<TY_Q4_K>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    int sb = c / 8, g = (c % 8) / 2, h = c % 2;
    const u8* meta = w.s + (row * (w.n_in / 256) + sb) * 16;
    float d = f16_to_f32(load_u16(meta)), dmin = f16_to_f32(load_u16(meta + 2));
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * g, meta + 4, &sc0, &m0);
    scale_min_k4(2 * g + 1, meta + 4, &sc1, &m1);
    uint4 raw = *(const uint4*)(w.q + row * (w.n_in / 2) + 16 * c);
    u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    float d0 = d * sc0, o0 = -dmin * m0, d1 = d * sc1, o1 = -dmin * m1;
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 4; b++) {
            u32 byte = (words[k] >> (8 * b)) & 0xff;
            y[4 * k + b] = d0 * (float)(byte & 15) + o0;
            y[16 + 4 * k + b] = d1 * (float)(byte >> 4) + o1;
        }
    *at0 = 256 * sb + 64 * g + 16 * h;
    *at1 = *at0 + 32;
}

// Q6_K: chunk c is 16 bytes of a super-block's 128 low-bit bytes (`q`), with the 16 matching
// bytes of its 64 high-bit bytes (`m`). In half `half` of the super-block, low-bit byte l < 32
// holds values l (low nibble) and l+64 (high); byte 32+l holds l+32 and l+96; high-bit byte l
// holds the top two bits of values l, l+32, l+64, l+96. Metadata: 16 signed scales, then d (f16).
template <> __device__ __forceinline__ void chunk<TY_Q6_K>(const Weight& w, u64 row, int c, float* y, int* at0, int* at1) {
    int sb = c / 8, half = (c % 8) / 4, k = c % 4;
    const u8* meta = w.s + (row * (w.n_in / 256) + sb) * 20;
    float d = f16_to_f32(load_u16(meta + 16));
    int l0 = 16 * (k % 2);                 // first l of this chunk
    int second = k / 2;                    // bytes 32+l: values +32
    uint4 lraw = *(const uint4*)(w.q + row * (w.n_in / 2) + 128 * sb + 64 * half + 32 * second + l0);
    uint4 hraw = *(const uint4*)(w.m + row * (w.n_in / 4) + 64 * sb + 32 * half + l0);
    u32 lw[4] = {lraw.x, lraw.y, lraw.z, lraw.w}, hw[4] = {hraw.x, hraw.y, hraw.z, hraw.w};
    int base = 32 * second + l0;           // value index (within the half) of the low nibbles
    float s_lo = d * (float)(i8)meta[8 * half + base / 16];
    float s_hi = d * (float)(i8)meta[8 * half + (base + 64) / 16];
    int shift_lo = 2 * second, shift_hi = 2 * second + 4;
    for (int j = 0; j < 4; j++)
        for (int b = 0; b < 4; b++) {
            u32 lo = (lw[j] >> (8 * b)) & 0xff, hi = (hw[j] >> (8 * b)) & 0xff;
            int q0 = (int)((lo & 15) | (((hi >> shift_lo) & 3) << 4)) - 32;
            int q1 = (int)((lo >> 4) | (((hi >> shift_hi) & 3) << 4)) - 32;
            y[4 * j + b] = s_lo * (float)q0;
            y[16 + 4 * j + b] = s_hi * (float)q1;
        }
    *at0 = 256 * sb + 128 * half + base;
    *at1 = *at0 + 64;
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
