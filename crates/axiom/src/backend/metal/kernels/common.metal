// Shared by every kernel: concatenated before the other sources when the library is compiled.
//
// Weights keep their stored blocks, GGUF's or FP8 checkpoints' (the arena is shared memory:
// uploading is a copy). Each weight type is a struct naming its block shape and a `visit_sub`
// that hands every value of one sub-block (at most 32 values, `sub_len`) to a functor,
// `f(index_in_block, value)`, with exactly the reference dequantization. `visit` runs over a
// whole block; the row matmul, the tiled matmul and embed are written once over them.
#include <metal_stdlib>
using namespace metal;

inline float load_f16(device const uchar* p) { return float(as_type<half>(ushort(p[0] | (p[1] << 8)))); }
inline float load_bf16(device const uchar* p) { return as_type<float>(uint(p[0] | (p[1] << 8)) << 16); }
inline float load_f32(device const uchar* p) {
    return as_type<float>(uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24));
}
inline int signed_byte(uchar v) { return int(v) - (v >= 128 ? 256 : 0); }

struct F32 {
    enum { block_len = 1, block_bytes = 4, sub_len = 1 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) { f(0, load_f32(b)); }
};

struct F16 {
    enum { block_len = 1, block_bytes = 2, sub_len = 1 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) { f(0, load_f16(b)); }
};

struct BF16 {
    enum { block_len = 1, block_bytes = 2, sub_len = 1 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) { f(0, load_bf16(b)); }
};

// d (f16), 32 signed bytes.
struct Q8_0 {
    enum { block_len = 32, block_bytes = 34, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) {
        float d = load_f16(b);
        for (uint i = 0; i < 32; i++) f(i, d * float(signed_byte(b[2 + i])));
    }
};

// d (f16), 16 bytes of nibbles: value j is the low nibble of byte j, value j + 16 the high one.
struct Q4_0 {
    enum { block_len = 32, block_bytes = 18, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) {
        float d = load_f16(b);
        for (uint j = 0; j < 16; j++) {
            f(j, d * (float(b[2 + j] & 15) - 8.0f));
            f(j + 16, d * (float(b[2 + j] >> 4) - 8.0f));
        }
    }
};

// d, m (f16), then nibbles as Q4_0: value = d * q + m.
struct Q4_1 {
    enum { block_len = 32, block_bytes = 20, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) {
        float d = load_f16(b), m = load_f16(b + 2);
        for (uint j = 0; j < 16; j++) {
            f(j, d * float(b[4 + j] & 15) + m);
            f(j + 16, d * float(b[4 + j] >> 4) + m);
        }
    }
};

// d (f16), the fifth bits (u32, bit j for value j), then nibbles as Q4_0: value = d * (q - 16).
struct Q5_0 {
    enum { block_len = 32, block_bytes = 22, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) {
        float d = load_f16(b);
        uint high = uint(b[2]) | (uint(b[3]) << 8) | (uint(b[4]) << 16) | (uint(b[5]) << 24);
        for (uint j = 0; j < 16; j++) {
            uint q0 = (b[6 + j] & 15) | (((high >> j) & 1) << 4);
            uint q1 = (b[6 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
            f(j, d * (float(q0) - 16.0f));
            f(j + 16, d * (float(q1) - 16.0f));
        }
    }
};

// The 6-bit scale and min of sub-block j (0..8) of a Q4_K super-block's 12 packed bytes.
inline void scale_min_k4(uint j, device const uchar* q, thread uint& scale, thread uint& min) {
    if (j < 4) {
        scale = q[j] & 63;
        min = q[j + 4] & 63;
    } else {
        scale = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// d, dmin (f16), 12 bytes of packed scales and mins, 128 bytes of nibbles: 8 sub-blocks of 32;
// the 32-byte group c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
struct Q4_K {
    enum { block_len = 256, block_bytes = 144, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint j, thread F& f) {
        float d = load_f16(b), dmin = load_f16(b + 2);
        uint scale, min;
        scale_min_k4(j, b + 4, scale, min);
        float dl = d * float(scale), ml = dmin * float(min);
        device const uchar* q = b + 16 + 32 * (j / 2);
        uint shift = 4 * (j % 2);
        for (uint l = 0; l < 32; l++) f(32 * j + l, dl * float((q[l] >> shift) & 15) - ml);
    }
};

// 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed scales, d (f16). In half h of 128
// values, quarter c (sub-block 4h + c) takes value l from the low (c < 2) or high nibble of byte
// l + 32 * (c % 2) and the bits 2c of high byte l; a scale per 16 values.
struct Q6_K {
    enum { block_len = 256, block_bytes = 210, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint j, thread F& f) {
        float d = load_f16(b + 208);
        uint h = j / 4, c = j % 4;
        device const uchar* ql = b + 64 * h + 32 * (c % 2);
        device const uchar* qh = b + 128 + 32 * h;
        device const uchar* sc = b + 192 + 8 * h + 2 * c;
        uint shift = 4 * (c / 2);
        for (uint l = 0; l < 32; l++) {
            int q = int(((ql[l] >> shift) & 15) | (((qh[l] >> (2 * c)) & 3) << 4)) - 32;
            f(32 * j + l, d * float(signed_byte(sc[l / 16])) * float(q));
        }
    }
};

// The value of an E4M3 code (format/fp8.rs): sign, 4 exponent bits (bias 7), 3 mantissa bits,
// no infinities, NaN at S.1111.111. Built from bits, so every code decodes exactly.
inline float e4m3_value(uint code) {
    uint exponent = (code >> 3) & 15, mantissa = code & 7;
    uint magnitude = (code & 0x7f) == 0x7f ? 0x7fc00000u                                   // NaN
                     : exponent == 0     ? as_type<uint>(float(mantissa) * (1.0f / 512.0f))  // m / 8 * 2^-6
                                         : ((exponent + 127 - 7) << 23) | (mantissa << 20);
    return as_type<float>(magnitude | ((code & 0x80) << 24));
}

// FP8 checkpoints' blocks: an f32 scale, then 32 E4M3 codes of a row; value = E4M3(code) * scale.
struct FP8_E4M3 {
    enum { block_len = 32, block_bytes = 36, sub_len = 32 };
    template <typename F> static void visit_sub(device const uchar* b, uint, thread F& f) {
        float scale = load_f32(b);
        for (uint i = 0; i < 32; i++) f(i, e4m3_value(b[4 + i]) * scale);
    }
};

// Every value of one block of W.
template <typename W, typename F> void visit(device const uchar* b, thread F& f) {
    for (uint j = 0; j < W::block_len / W::sub_len; j++) W::visit_sub(b, j, f);
}

// The paged KV cache: a sequence's position p lives in row table[p / page_size] * page_size +
// p % page_size of each layer's cache, where table is its row of the block tables.
inline ulong page_row(device const uint* table, uint page_size, uint p) {
    return ulong(table[p / page_size]) * page_size + p % page_size;
}

// A gate's activation, `act` as Activation::code: 0 SiLU, 1 GELU by its tanh approximation.
inline float activate(float g, uint act) {
    return act == 1 ? 0.5f * g * (1.0f + precise::tanh(0.7978845608f * (g + 0.044715f * g * g * g)))
                    : g / (1.0f + exp(-g));
}

// KV cache elements, f16 or f32.
inline float kv_load(device const half* p) { return float(*p); }
inline float kv_load(device const float* p) { return *p; }
