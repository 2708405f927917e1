// Every kernel's parameters, as one struct passed by value (a kernel's parameters live in its
// constant bank, so reading a field costs what reading a separate parameter did). The host lays out
// each one identically (cuda/params.rs); tests/cuda_nvrtc.rs compares their sizes and offsets.
// Caches of either element type (f16 as u16, or f32) are `void*`, cast by the kernel of that type.
// A pointer read from a struct is not a `const __restrict__` kernel parameter to the compiler, so
// the loads that took the read-only cache for being one (the norms' rows and weights, attention's
// positions and block tables) ask for it by __ldg.

// embed.cu: table rows (a Weight's fields) gathered by ids.
struct EmbedParams {
    const u8* q;
    const u8* s;
    const u8* m;
    int n_in;
    const u32* ids;
    float* out;
};

// rms_norm.cu
struct RmsNormParams {
    const float4* x;
    const float4* w;
    float4* out;
    int dim;
    float eps;
};

struct RmsNormPairParams {
    const float4* x[2];
    const float4* w[2];
    float4* out[2];
    u32 split;
    int dim;
    float eps;
};

struct RmsNorm16Params {
    const float4* x;
    const float4* w;
    uint2* out;
    int dim;
    float eps;
    int kind;
};

// rms_norm_16_fp8: rms_norm_16's fields, and the rows quantized for an FP8 product (as
// QuantizeFp8Params's codes and scales, the step padded to cols tokens).
struct RmsNormFp8Params {
    const float4* x;
    const float4* w;
    uint2* out;
    u32* codes;
    float* scales;
    int dim;
    float eps;
    int kind;
    int n_tokens;
    int cols;
};

// rms_norm_q8 and rms_norm_q8_1.
struct RmsNormQ8Params {
    const float4* x;
    const float4* w;
    u32* xq;
    float* xd;
    float4* rows;
    int dim;
    float eps;
    int interleave;
    int start_next;
};

// rope.cu
struct RopeParams {
    float* x;
    const u32* positions;
    const float* freqs;
    int n_heads;
    int head_dim;
    int dims;
    int halves;
    float scale;
};

// matmul.cu: up to three matrices of one type multiplied by the same activations in one launch
// (Q, K and V; gate and up). The GLU kernels take a gate and an up matrix and write silu(gate) *
// up.
#define MAX_MATRICES 3
struct Matrices {
    const u8* q[MAX_MATRICES];
    const u8* s[MAX_MATRICES];
    const u8* m[MAX_MATRICES];
    float* out[MAX_MATRICES];
    int n_out[MAX_MATRICES];
    int count;
    // Whether the products are added to out (the residual stream) instead of stored; not with GLU.
    int accumulate;
    // Whether the one-token Q4_K kernel copies all of a row pair that its two stages hold before
    // its wait (q4k_rows), where the kernel before reads little memory after its own.
    int copy_whole;
};

// The matrix-vector kernels on f32 activations.
struct GemvParams {
    Matrices mats;
    int n_in;
    const float* x;
};

// The matrix-vector kernels on int8 activations with their f32 block scales.
struct GemvIntParams {
    Matrices mats;
    int n_in;
    const i8* xq;
    const float* xd;
};

// The one-token matrix-vector kernels that RMS-normalize their input (by `norm`) first.
struct GemvNormedParams {
    Matrices mats;
    int n_in;
    const float* x;
    const float* norm;
    float eps;
};

struct QuantizeQ8Params {
    const float4* x;
    u32* xq;
    float* xd;
    u64 n;
    int n_in;
    int interleave;
    int start_next;
};

// fp8_gemm.cu: `n_tokens` rows of `n_in` (f32, or 16-bit of `kind`) quantized to E4M3 `codes` and
// `scales` for `cols` tokens.
struct QuantizeFp8Params {
    const void* x;
    const void* up;  // quantize_fp8_glu: up's rows (x holds gate's)
    u32* codes;
    float* scales;
    int n_tokens;
    int cols;
    int n_in;
    int kind;
    int act;  // quantize_fp8_glu: the activation (glu_of)
};

// dequant_f16_*: a Weight's fields, and its rows out in f16.
struct DequantParams {
    const u8* q;
    const u8* s;
    const u8* m;
    int n_in;
    u16* out;
    int n_out;
};

// kv_write.cu
struct KvWriteParams {
    const float* k;
    const float* v;
    void* k_cache;
    void* v_cache;
    const u32* positions;
    const u32* tables;
    int table_width;
    const u32* token_seqs;
    int page_size;
    int width;
};

// rope_kv_write.cu
struct RopeKvWriteParams {
    float* q;
    float* k;
    const float* v;
    void* k_cache;
    void* v_cache;
    const u32* positions;
    const float* freqs;
    const u32* tables;
    int table_width;
    const u32* token_seqs;
    int page_size;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int dims;
    int halves;
    float scale;
    int first_head;
    int group;
    float2* turns_out;
};

// attention.cu: k_new, v_new and freqs are null unless the kernel rotates and stores the step's
// token itself (NewToken); xq and xd unless it also quantizes its output. Scores are scale * q.k,
// capped to softcap * tanh(s / softcap) unless softcap is 0, over the last `window` positions up
// to the token's own (all of them where window is 0).
struct AttentionParams {
    const float* q;
    void* k_cache;
    void* v_cache;
    const u32* positions;
    const u32* tables;
    int table_width;
    const u32* token_seqs;
    int page_size;
    const float* k_new;
    const float* v_new;
    const float* freqs;
    int dims;
    int halves;
    float rope_scale;
    float* out;
    i8* xq;
    float* xd;
    int interleave;
    int start_next;
    u64* partials;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    float scale;
    float softcap;
    int window;
};

// flash_attention.cu and flash_attention_wg.cu (the scores' fields as in AttentionParams).
struct FlashAttentionParams {
    const float* q;
    const u16* k_cache;
    const u16* v_cache;
    const u32* positions;
    const u32* tables;
    int table_width;
    const u32* token_seqs;
    int page_size;
    const u32* tiles;
    const float2* turns;
    int pairing;
    void* out;
    int out_type;
    int n_heads;
    int n_kv_heads;
    float scale;
    float softcap;
    int window;
};

// elementwise.cu
struct GluParams {
    const float* gate;
    const float* up;
    float* out;
    u64 n;
    int act;
};

struct Glu16Params {
    const u16* gate;
    const u16* up;
    u16* out;
    u64 n;
    int kind;
    int act;
};

struct ScaleParams {
    float* x;
    u64 n;
    float factor;
};

struct AddParams {
    float* x;
    const float* y;
    u64 n;
};

struct AddBiasParams {
    float* x;
    const float* bias;
    u64 n;
    u64 width;
};

struct ConvertF32Params {
    const float* x;
    u16* out;
    u64 n;
    int kind;
};

// argmax.cu
struct ArgmaxParams {
    const float* rows;
    int n;
    const u32* allowed;
    u32* outs;
    u32* chosen;
    const u32* chosen_at;
    u32* position;
    u64* keys;
    u32* arrivals;
};

// experts.cu
struct RouteParams {
    const float* logits;
    u32* ids;
    float* weights;
    int n_tokens;
    int n_experts;
    int k;
    int renormalize;
};

// The router's rows (n_experts of n_in, the kernel's type) times x's n_tokens rows, into
// route.logits, then routed; `done` counts the blocks that have written their logits.
struct RouterRouteParams {
    const u8* w;
    const float* x;
    u32* done;
    int n_in;
    RouteParams route;
};

// One matrix of every expert: expert e's fields at e times each stride (bytes) from expert 0's.
struct ExpertWeights {
    const u8* q;
    const u8* s;
    const u8* m;
    u64 q_stride;
    u64 s_stride;
    u64 m_stride;
};

struct ExpertProductParams {
    ExpertWeights w;
    ExpertWeights up;
    const u32* ids;
    const u32* offsets;
    const float* x;
    const i8* xq;
    const float* xd;
    float* out;
    int n_in;
    int n_out;
    int n_experts;
    int rows_per_token;
    int act;
    int out_type;
};

struct ExpertDownSumParams {
    ExpertWeights w;
    const u32* ids;
    const float* weights;
    const float* x;
    const i8* xq;
    const float* xd;
    float* residual;
    int n_in;
    int n_out;
    int n_experts;
    int k;
    int groups;
};

struct GroupPairsParams {
    const u32* ids;
    u32* offsets;
    u32* slots;
    u32* pairs;
    u32* counts;
    int n_pairs;
    int n_experts;
};

struct GatherPairsParams {
    const float4* x;
    void* rows;
    const u32* pairs;
    const u32* offsets;
    int n_experts;
    int k;
    int dim;
    int row_type;
};

struct ExpertsSumParams {
    float* residual;
    const float* out;
    const u32* ids;
    const float* weights;
    const u32* slots;
    u64 n;
    int dim;
    int k;
    int n_experts;
};

struct AddGatedParams {
    float* x;
    const float* rows;
    const float* gates;
    u64 n;
    u64 width;
};
