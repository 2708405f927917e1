// C entry points that launch each Metal kernel on the CPU, with the grid the Metal backend uses
// (crates/axiom/src/backend/metal/mod.rs) and the thread counts the caller chooses.
#include "launch.h"

#include "kernels.inc"

using msl_cpu::launch;
using msl_cpu::Thread;

// Type ids, as in format/quant.rs: GGUF's, and FP8 checkpoints' blocks at the id no GGUF type uses.
#define WEIGHT_TYPES(X)                                                                                              \
    X(0, f32) X(1, f16) X(30, bf16) X(8, q8_0) X(2, q4_0) X(3, q4_1) X(6, q5_0) X(12, q4_k) X(14, q6_k)              \
    X(0xffffffffu, fp8)

// `g` and `eps` are the RMS norm taken on the way in where `normed` is set.
extern "C" int msl_matmul(uint ty, const uchar* w, const float* x, const float* g, float eps, uint normed, float* out,
                          uint n_in, uint n_out, uint n_tokens, uint accumulate, uint simds_per_group) {
    uint3 groups = {(n_out + simds_per_group - 1) / simds_per_group, 1, 1};
    uint3 threads = {simds_per_group * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(ID, NAME)                                                                                   \
    case ID:                                                                                             \
        launch(groups, threads, [&](const Thread& t) {                                                   \
            matmul_##NAME(w, x, out, n_in, n_out, n_tokens, accumulate, g, eps, normed, t.group.x, t.simd, \
                          t.simds, t.lane, t.lanes);                                                     \
        });                                                                                              \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

extern "C" int msl_matmul_glu(uint ty, const uchar* w_gate, const uchar* w_up, const float* x, const float* g,
                              float eps, uint normed, float* out, uint n_in, uint n_out, uint n_tokens, uint act,
                              uint simds_per_group) {
    uint3 groups = {(n_out + simds_per_group - 1) / simds_per_group, 1, 1};
    uint3 threads = {simds_per_group * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(ID, NAME)                                                                                           \
    case ID:                                                                                                     \
        launch(groups, threads, [&](const Thread& t) {                                                           \
            matmul_glu_##NAME(w_gate, w_up, x, out, n_in, n_out, n_tokens, act, g, eps, normed, t.group.x, t.simd, \
                              t.simds, t.lane, t.lanes);                                                         \
        });                                                                                                      \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

// One row of threadgroups per (token, choice) pair, `simds_per_group` rows each.
extern "C" int msl_matmul_experts(uint ty, const uchar* w, const uint* ids, const float* x, float* out, uint n_in,
                                  uint n_out, uint expert_bytes, uint n_experts, uint per_x, uint pairs,
                                  uint simds_per_group) {
    uint3 groups = {(n_out + simds_per_group - 1) / simds_per_group, pairs, 1};
    uint3 threads = {simds_per_group * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(ID, NAME)                                                                                           \
    case ID:                                                                                                     \
        launch(groups, threads, [&](const Thread& t) {                                                           \
            matmul_experts_##NAME(w, ids, x, out, n_in, n_out, expert_bytes, n_experts, per_x, {t.group.x, t.group.y}, \
                                  t.simd, t.simds, t.lane, t.lanes);                                             \
        });                                                                                                      \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

extern "C" int msl_matmul_glu_experts(uint ty, const uchar* w_gate, const uchar* w_up, const uint* ids, const float* x,
                                      float* out, uint n_in, uint n_out, uint expert_bytes, uint n_experts, uint per_x,
                                      uint act, uint pairs, uint simds_per_group) {
    uint3 groups = {(n_out + simds_per_group - 1) / simds_per_group, pairs, 1};
    uint3 threads = {simds_per_group * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(ID, NAME)                                                                                              \
    case ID:                                                                                                        \
        launch(groups, threads, [&](const Thread& t) {                                                              \
            matmul_glu_experts_##NAME(w_gate, w_up, ids, x, out, n_in, n_out, expert_bytes, n_experts, per_x, act,  \
                                      {t.group.x, t.group.y}, t.simd, t.simds, t.lane, t.lanes);                    \
        });                                                                                                         \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

// Tiles of TILE_T tokens by TILE_O rows, TILE_SIMDS simdgroups each (matmul_tiled.metal).
extern "C" int msl_matmul_tiled(uint ty, const uchar* w, const float* x, float* out, uint n_in, uint n_out,
                                uint n_tokens, uint accumulate) {
    uint3 groups = {(n_out + TILE_O - 1) / TILE_O, (n_tokens + TILE_T - 1) / TILE_T, 1};
    uint3 threads = {TILE_SIMDS * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(ID, NAME)                                                                                              \
    case ID:                                                                                                        \
        launch(groups, threads, [&](const Thread& t) {                                                              \
            matmul_tiled_##NAME(w, x, out, n_in, n_out, n_tokens, accumulate, {t.group.x, t.group.y}, t.index,       \
                                {t.threads, 1}, t.simd);                                                              \
        });                                                                                                         \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

extern "C" int msl_embed(uint ty, const uchar* table, const uint* ids, float* out, uint dim, uint n_tokens,
                         uint threads) {
#define CASE(ID, NAME)                                                                                        \
    case ID:                                                                                                  \
        launch({n_tokens, 1, 1}, {threads, 1, 1},                                                             \
               [&](const Thread& t) { embed_##NAME(table, ids, out, dim, t.group.x, t.index, t.threads); }); \
        return 0;
    switch (ty) { WEIGHT_TYPES(CASE) }
#undef CASE
    return 1;
}

extern "C" void msl_rms_norm(const float* x, const float* w, float* out, uint dim, float eps, uint rows,
                             uint threads) {
    launch({rows, 1, 1}, {threads, 1, 1}, [&](const Thread& t) {
        rms_norm(x, w, out, dim, eps, t.group.x, t.index, t.threads, t.simd, t.simds, t.lane);
    });
}

extern "C" void msl_rope(float* x, const uint* positions, const float* freqs, uint n_tokens, uint n_heads,
                         uint head_dim, uint dims, uint halves, float scale, uint threads) {
    launch({n_tokens, n_heads, 1}, {threads, 1, 1}, [&](const Thread& t) {
        rope(x, positions, freqs, n_heads, head_dim, dims, halves, scale, {t.group.x, t.group.y}, t.index,
             {t.threads, 1});
    });
}

// The paged-KV arguments every cache kernel takes.
struct Paged {
    const uint* positions;
    const uint* tables;
    uint table_width;
    const uint* token_seqs;
    uint page_size;
};

// How attention weighs what a token sees (axiom's `Scores`): cap 0, window 0 for none.
struct Rule {
    float scale;
    float softcap;
    uint window;
};

extern "C" void msl_kv_write(uint f16, const float* k, const float* v, void* k_cache, void* v_cache, Paged p,
                             uint n_tokens, uint kv_width, uint threads) {
    launch({n_tokens, 1, 1}, {threads, 1, 1}, [&](const Thread& t) {
        if (f16)
            kv_write_f16(k, v, (half*)k_cache, (half*)v_cache, p.positions, p.tables, p.table_width, p.token_seqs,
                         p.page_size, kv_width, t.group.x, t.index, t.threads);
        else
            kv_write_f32(k, v, (float*)k_cache, (float*)v_cache, p.positions, p.tables, p.table_width, p.token_seqs,
                         p.page_size, kv_width, t.group.x, t.index, t.threads);
    });
}

extern "C" void msl_rope_kv_write(uint f16, float* q, float* k, const float* v, void* k_cache, void* v_cache,
                                  const float* freqs, Paged p, uint n_tokens, uint n_heads, uint n_kv_heads,
                                  uint head_dim, uint dims, uint halves, float scale, uint threads) {
    launch({n_tokens, n_heads + n_kv_heads, 1}, {threads, 1, 1}, [&](const Thread& t) {
        uint2 group = {t.group.x, t.group.y};
        if (f16)
            rope_kv_write_f16(q, k, v, (half*)k_cache, (half*)v_cache, p.positions, freqs, p.tables, p.table_width,
                              p.token_seqs, p.page_size, n_heads, n_kv_heads, head_dim, dims, halves, scale, group,
                              t.index, {t.threads, 1});
        else
            rope_kv_write_f32(q, k, v, (float*)k_cache, (float*)v_cache, p.positions, freqs, p.tables, p.table_width,
                              p.token_seqs, p.page_size, n_heads, n_kv_heads, head_dim, dims, halves, scale, group,
                              t.index, {t.threads, 1});
    });
}

extern "C" void msl_attention(uint f16, const float* q, const void* k_cache, const void* v_cache, Paged p, float* out,
                              uint n_tokens, uint n_heads, uint n_kv_heads, uint head_dim, Rule r,
                              uint simds_per_group) {
    launch({n_tokens, n_heads, 1}, {simds_per_group * msl_cpu::SIMD_WIDTH, 1, 1}, [&](const Thread& t) {
        uint2 group = {t.group.x, t.group.y};
        if (f16)
            attention_f16(q, (const half*)k_cache, (const half*)v_cache, p.positions, p.tables, p.table_width,
                          p.token_seqs, p.page_size, out, n_heads, n_kv_heads, head_dim, r.scale, r.softcap, r.window,
                          group, t.index, {t.threads, 1}, t.simd, t.simds, t.lane, t.lanes);
        else
            attention_f32(q, (const float*)k_cache, (const float*)v_cache, p.positions, p.tables, p.table_width,
                          p.token_seqs, p.page_size, out, n_heads, n_kv_heads, head_dim, r.scale, r.softcap, r.window,
                          group, t.index, {t.threads, 1}, t.simd, t.simds, t.lane, t.lanes);
    });
}

// Tiles of FA_ROWS tokens by one head, FA_SIMDS simdgroups each (flash_attention.metal); `head_max`
// picks the kernel of that head-dim class.
extern "C" int msl_flash_attention(uint f16, uint head_max, const float* q, const void* k_cache, const void* v_cache,
                                   Paged p, float* out, uint n_tokens, uint n_heads, uint n_kv_heads, uint head_dim,
                                   Rule r) {
    uint3 groups = {(n_tokens + FA_ROWS - 1) / FA_ROWS, n_heads, 1};
    uint3 threads = {FA_SIMDS * msl_cpu::SIMD_WIDTH, 1, 1};
#define CASE(HEAD_MAX)                                                                                             \
    case HEAD_MAX:                                                                                                 \
        launch(groups, threads, [&](const Thread& t) {                                                             \
            uint2 tile = {t.group.x, t.group.y};                                                                   \
            if (f16)                                                                                               \
                flash_attention_f16_##HEAD_MAX(q, (const half*)k_cache, (const half*)v_cache, p.positions, p.tables, \
                                               p.table_width, p.token_seqs, p.page_size, out, n_tokens, n_heads,   \
                                               n_kv_heads, head_dim, r.scale, r.softcap, r.window, tile, t.index,  \
                                               {t.threads, 1}, t.simd, t.lane);                                    \
            else                                                                                                   \
                flash_attention_f32_##HEAD_MAX(q, (const float*)k_cache, (const float*)v_cache, p.positions,       \
                                               p.tables, p.table_width, p.token_seqs, p.page_size, out, n_tokens,  \
                                               n_heads, n_kv_heads, head_dim, r.scale, r.softcap, r.window, tile,  \
                                               t.index, {t.threads, 1}, t.simd, t.lane);                           \
        });                                                                                                        \
        return 0;
    switch (head_max) { CASE(64) CASE(128) CASE(256) }
#undef CASE
    return 1;
}

extern "C" void msl_attention_qk(uint f16, const float* q, const void* k_cache, Paged p, float* scores, uint n_tokens,
                                 uint n_heads, uint n_kv_heads, uint head_dim, uint n_ctx, Rule r, uint threads) {
    // One thread per score; `threads` wide groups along the positions.
    uint3 groups = {(n_ctx + threads - 1) / threads, n_tokens * n_heads, 1};
    launch(groups, {threads, 1, 1}, [&](const Thread& t) {
        uint2 at = {t.grid.x, t.grid.y};
        if (f16)
            attention_qk_f16(q, (const half*)k_cache, p.positions, p.tables, p.table_width, p.token_seqs, p.page_size,
                             scores, n_tokens, n_heads, n_kv_heads, head_dim, n_ctx, r.scale, r.softcap, r.window, at);
        else
            attention_qk_f32(q, (const float*)k_cache, p.positions, p.tables, p.table_width, p.token_seqs,
                             p.page_size, scores, n_tokens, n_heads, n_kv_heads, head_dim, n_ctx, r.scale, r.softcap,
                             r.window, at);
    });
}

extern "C" void msl_attention_pv(uint f16, const float* scores, const void* v_cache, Paged p, float* out,
                                 uint n_tokens, uint n_heads, uint n_kv_heads, uint head_dim, uint n_ctx,
                                 uint threads) {
    launch({n_tokens * n_heads, 1, 1}, {threads, 1, 1}, [&](const Thread& t) {
        if (f16)
            attention_pv_f16(scores, (const half*)v_cache, p.positions, p.tables, p.table_width, p.token_seqs,
                             p.page_size, out, n_heads, n_kv_heads, head_dim, n_ctx, t.group.x, t.index, t.threads);
        else
            attention_pv_f32(scores, (const float*)v_cache, p.positions, p.tables, p.table_width, p.token_seqs,
                             p.page_size, out, n_heads, n_kv_heads, head_dim, n_ctx, t.group.x, t.index, t.threads);
    });
}

extern "C" void msl_glu(const float* gate, const float* up, float* out, uint n, uint act, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { glu(gate, up, out, n, act, t.grid.x); });
}

extern "C" void msl_scale(float* x, uint n, float factor, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { scale(x, n, factor, t.grid.x); });
}

extern "C" void msl_softcap(float* x, uint n, float cap, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { softcap(x, n, cap, t.grid.x); });
}

extern "C" void msl_add(float* x, const float* y, uint n, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1}, [&](const Thread& t) { add(x, y, n, t.grid.x); });
}

extern "C" void msl_add_bias(float* x, const float* bias, uint n, uint width, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { add_bias(x, bias, n, width, t.grid.x); });
}

extern "C" void msl_argmax(const float* x, const uint* allowed, uint constrained, uint* out, uint width, uint rows,
                           uint threads) {
    launch({rows, 1, 1}, {threads, 1, 1}, [&](const Thread& t) {
        argmax(x, out, width, allowed, constrained, t.group.x, t.index, t.threads, t.simd, t.simds, t.lane);
    });
}

// One simdgroup per token.
extern "C" void msl_route(const float* logits, uint* ids, float* weights, uint n_experts, uint k, uint renormalize,
                          uint n_tokens) {
    launch({n_tokens, 1, 1}, {msl_cpu::SIMD_WIDTH, 1, 1}, [&](const Thread& t) {
        route(logits, ids, weights, n_experts, k, renormalize, t.group.x, t.lane, t.lanes);
    });
}

extern "C" void msl_experts_sum(float* residual, const float* rows, const float* weights, uint n, uint width, uint k,
                                uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { experts_sum(residual, rows, weights, n, width, k, t.grid.x); });
}

extern "C" void msl_add_gated(float* x, const float* rows, const float* gates, uint n, uint width, uint threads) {
    launch({(n + threads - 1) / threads, 1, 1}, {threads, 1, 1},
           [&](const Thread& t) { add_gated(x, rows, gates, n, width, t.grid.x); });
}
