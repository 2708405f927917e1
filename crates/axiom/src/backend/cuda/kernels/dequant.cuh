// Reference-exact dequantization of one quantization block into 32 floats (K-quants: one
// 32-value sub-block of a 256-value super-block). Layouts as in format/quant.rs.

template <int TY> struct Block;

template <> struct Block<TY_Q8_0> {
    static constexpr int ELEMS = 32, BYTES = 34, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        float d = f16_to_f32(load_u16(b));
        for (int j = 0; j < 32; j++) y[j] = d * (float)(i8)b[2 + j];
    }
};

template <> struct Block<TY_Q4_0> {
    static constexpr int ELEMS = 32, BYTES = 18, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        float d = f16_to_f32(load_u16(b));
        for (int j = 0; j < 16; j++) {
            u8 q = b[2 + j];
            y[j] = d * (float)((int)(q & 15) - 8);
            y[j + 16] = d * (float)((int)(q >> 4) - 8);
        }
    }
};

template <> struct Block<TY_Q4_1> {
    static constexpr int ELEMS = 32, BYTES = 20, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
        for (int j = 0; j < 16; j++) {
            u8 q = b[4 + j];
            y[j] = d * (float)(q & 15) + m;
            y[j + 16] = d * (float)(q >> 4) + m;
        }
    }
};

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <> struct Block<TY_Q4_K> {
    static constexpr int ELEMS = 256, BYTES = 144, SUB = 8;
    // Sub-block s (0..8) of 32 values.
    __device__ static void load(const u8* b, int s, float* y) {
        float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        const u8* q = b + 16 + (s / 2) * 32;
        int shift = 4 * (s % 2);
        float dl = d * sc, ml = dmin * m;
        for (int l = 0; l < 32; l++) y[l] = dl * (float)((q[l] >> shift) & 15) - ml;
    }
};

template <> struct Block<TY_Q6_K> {
    static constexpr int ELEMS = 256, BYTES = 210, SUB = 8;
    // Sub-block s covers values 32s .. 32s+31: half s/4, quarter (s%4) of it.
    __device__ static void load(const u8* b, int s, float* y) {
        float d = f16_to_f32(load_u16(b + 208));
        int half = s / 4, part = s % 4;
        const u8* ql = b + 64 * half;
        const u8* qh = b + 128 + 32 * half;
        const i8* sc = (const i8*)(b + 192 + 8 * half);
        for (int l = 0; l < 32; l++) {
            int q;
            switch (part) {
                case 0: q = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4); break;
                case 1: q = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4); break;
                case 2: q = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4); break;
                default: q = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4); break;
            }
            y[l] = d * (float)sc[2 * part + l / 16] * (float)(q - 32);
        }
    }
};

// Float types, 32 values at a time.
template <> struct Block<TY_F32> {
    static constexpr int ELEMS = 32, BYTES = 128, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        const float4* p = (const float4*)b;
        for (int j = 0; j < 8; j++) {
            float4 v = p[j];
            y[4 * j] = v.x; y[4 * j + 1] = v.y; y[4 * j + 2] = v.z; y[4 * j + 3] = v.w;
        }
    }
};

template <> struct Block<TY_F16> {
    static constexpr int ELEMS = 32, BYTES = 64, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        const uint4* p = (const uint4*)b;
        for (int j = 0; j < 4; j++) {
            uint4 v = p[j];
            u32 w[4] = {v.x, v.y, v.z, v.w};
            for (int k = 0; k < 4; k++) {
                y[8 * j + 2 * k] = f16_to_f32((u16)(w[k] & 0xffff));
                y[8 * j + 2 * k + 1] = f16_to_f32((u16)(w[k] >> 16));
            }
        }
    }
};

template <> struct Block<TY_BF16> {
    static constexpr int ELEMS = 32, BYTES = 64, SUB = 1;
    __device__ static void load(const u8* b, int, float* y) {
        const uint4* p = (const uint4*)b;
        for (int j = 0; j < 4; j++) {
            uint4 v = p[j];
            u32 w[4] = {v.x, v.y, v.z, v.w};
            for (int k = 0; k < 4; k++) {
                y[8 * j + 2 * k] = __uint_as_float(w[k] << 16);
                y[8 * j + 2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
            }
        }
    }
};

// Value pieces of 32 in a row of n values, and where piece p starts.
template <int TY> __device__ __forceinline__ const u8* piece(const u8* row, int p, int* sub) {
    *sub = p % Block<TY>::SUB;
    return row + (p / Block<TY>::SUB) * Block<TY>::BYTES;
}
