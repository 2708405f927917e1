// Causal grouped-query attention for prompts, flash-attention style: no score matrix in memory,
// each key and value row read once per tile of FA_ROWS queries instead of once per query.
// A threadgroup of FA_SIMDS simdgroups takes FA_ROWS consecutive tokens of the step and one
// query head (reading KV head h / (n_heads / n_kv_heads)); simdgroup s owns rows 8s..8s+7 and
// holds their queries, scaled, and their outputs in 8x8 simdgroup matrices. The tile's tokens
// may belong to several sequences: each one in turn (a segment) streams its positions through
// threadgroup memory KEYS at a time, the other rows masked. For each tile of keys: the keys,
// staged transposed, give S = Q K^T; one lane per key caps the scores and masks them (causal,
// window: the rule as attention.metal takes it), and each row's online softmax keeps its max and
// sum; the values, staged where the keys were, give O = diag(correction) O + P V. A simdgroup
// whose rows see none of a tile skips its products. Head dims up to HEAD_MAX (a kernel per class
// of 64, 128 and 256), padded with zeros to it.
enum { FA_ROWS = 32, FA_SIMDS = 4, FA_STAGE = 4096, FA_MAX_KEYS = 32 };
static_assert(FA_ROWS == 8 * FA_SIMDS, "a simdgroup owns 8 rows");
#define FA_NONE 0xffffffffu  // a row of no sequence; as a bound, past every position

template <typename T, uint HEAD_MAX>
void flash_attention_tile(device const float* q, device const T* k_cache, device const T* v_cache,
                          device const uint* positions, device const uint* tables, uint table_width,
                          device const uint* token_seqs, uint page_size, device float* out, uint n_tokens,
                          uint n_heads, uint n_kv_heads, uint head_dim, float scale, float softcap, uint window,
                          uint2 tile, uint tid, uint threads, uint simd, uint lane, threadgroup float* stage,
                          threadgroup float* scores, threadgroup float* diag, threadgroup uint* row_seq,
                          threadgroup uint* row_pos, threadgroup uint* row_lo) {
    // A tile of keys fills the stage: KEYS rows of HEAD_MAX.
    constexpr uint KEYS = uint(FA_STAGE) / HEAD_MAX < uint(FA_MAX_KEYS) ? uint(FA_STAGE) / HEAD_MAX : uint(FA_MAX_KEYS);
    constexpr uint QCOLS = FA_STAGE / FA_ROWS;  // the queries' columns staged at once
    // Every loop over a head's blocks runs to the class's bound, over zeros past head_dim: the
    // compiler can then unroll them and keep the matrices in registers.
    constexpr uint BLOCKS = HEAD_MAX / 8;
    static_assert(KEYS % 8 == 0 && HEAD_MAX % 8 == 0 && KEYS <= 32, "whole 8x8 blocks, a lane per key");
    uint t0 = tile.x * FA_ROWS, h = tile.y;
    uint kv_width = n_kv_heads * head_dim, kv_off = (h / (n_heads / n_kv_heads)) * head_dim;
    threadgroup float* my_scores = scores + simd * 8 * KEYS;
    threadgroup float* my_diag = diag + simd * 64;

    if (tid < FA_ROWS) {
        uint t = t0 + tid, pos = t < n_tokens ? positions[t] : 0;
        row_seq[tid] = t < n_tokens ? token_seqs[t] : FA_NONE;
        row_pos[tid] = pos;
        row_lo[tid] = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
    }
    for (uint i = tid; i < FA_SIMDS * 64; i += threads) diag[i] = 0.0f;
    simdgroup_float8x8 qm[BLOCKS], om[BLOCKS];
    const simdgroup_float8x8 zero = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint c0 = 0; c0 < HEAD_MAX; c0 += QCOLS) {
        for (uint e = tid; e < FA_ROWS * QCOLS; e += threads) {
            uint t = t0 + e / QCOLS, d = c0 + e % QCOLS;
            stage[e] = t < n_tokens && d < head_dim ? q[(ulong(t) * n_heads + h) * head_dim + d] * scale : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint j = c0 / 8; j < BLOCKS && j < (c0 + QCOLS) / 8; j++)
            simdgroup_load(qm[j], stage + 8 * simd * QCOLS + 8 * j - c0, QCOLS);
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the next columns overwrite the stage
    }
    for (uint j = 0; j < BLOCKS; j++) om[j] = zero;
    // Finite stand-ins for -inf (fast math may assume no infinities): a masked score is -FLT_MAX,
    // a row's max starts at half that, so exp of either against any max is 0 and no row needs a case.
    float m[8], l[8];
    for (uint r = 0; r < 8; r++) {
        m[r] = -FLT_MAX / 2;
        l[r] = 0.0f;
    }

    for (uint lead = 0; lead < FA_ROWS; lead++) {
        // A segment starts at each sequence's first row in the tile.
        uint seq = row_seq[lead];
        bool first = seq != FA_NONE;
        for (uint r = 0; r < lead; r++) first = first && row_seq[r] != seq;
        if (!first) continue;
        uint lo = FA_NONE, hi = 0, my_lo = FA_NONE, my_hi = 0;
        for (uint r = 0; r < FA_ROWS; r++) {
            if (row_seq[r] != seq) continue;
            lo = min(lo, row_lo[r]);
            hi = max(hi, row_pos[r]);
            if (r / 8 == simd) {
                my_lo = min(my_lo, row_lo[r]);
                my_hi = max(my_hi, row_pos[r]);
            }
        }
        device const uint* table = tables + ulong(seq) * table_width;
        for (uint k0 = lo; k0 <= hi; k0 += KEYS) {
            bool active = my_lo <= my_hi && my_lo < k0 + KEYS && my_hi >= k0;
            for (uint e = tid; e < KEYS * HEAD_MAX; e += threads) {
                uint j = e / HEAD_MAX, d = e % HEAD_MAX, p = k0 + j;
                stage[d * KEYS + j] =
                    p <= hi && d < head_dim ? kv_load(k_cache + page_row(table, page_size, p) * kv_width + kv_off + d)
                                            : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                simdgroup_float8x8 s[KEYS / 8];
                for (uint i = 0; i < KEYS / 8; i++) s[i] = zero;
                for (uint j = 0; j < BLOCKS; j++)
                    for (uint i = 0; i < KEYS / 8; i++) {
                        simdgroup_float8x8 kt;
                        simdgroup_load(kt, stage + 8 * j * KEYS + 8 * i, KEYS);
                        simdgroup_multiply_accumulate(s[i], qm[j], kt, s[i]);
                    }
                for (uint i = 0; i < KEYS / 8; i++) simdgroup_store(s[i], my_scores + 8 * i, KEYS);
                simdgroup_barrier(mem_flags::mem_threadgroup);
                uint p = k0 + lane;
                for (uint r = 0; r < 8; r++) {
                    uint row = 8 * simd + r;
                    bool seen = lane < KEYS && row_seq[row] == seq && p >= row_lo[row] && p <= row_pos[row];
                    float x = seen ? my_scores[r * KEYS + lane] : -FLT_MAX;
                    if (seen && softcap != 0.0f) x = softcap * precise::tanh(x / softcap);
                    float m_new = max(m[r], simd_max(x));
                    float e = exp(x - m_new), correction = exp(m[r] - m_new);
                    l[r] = l[r] * correction + simd_sum(e);
                    m[r] = m_new;
                    if (lane < KEYS) my_scores[r * KEYS + lane] = e;
                    if (lane == 0) my_diag[9 * r] = correction;
                }
                simdgroup_barrier(mem_flags::mem_threadgroup);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the keys
            for (uint e = tid; e < KEYS * HEAD_MAX; e += threads) {
                uint j = e / HEAD_MAX, d = e % HEAD_MAX, p = k0 + j;
                stage[e] = p <= hi && d < head_dim
                               ? kv_load(v_cache + page_row(table, page_size, p) * kv_width + kv_off + d)
                               : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                simdgroup_float8x8 correction, pm[KEYS / 8];
                simdgroup_load(correction, my_diag, 8);
                for (uint i = 0; i < KEYS / 8; i++) simdgroup_load(pm[i], my_scores + 8 * i, KEYS);
                for (uint j = 0; j < BLOCKS; j++) {
                    simdgroup_multiply_accumulate(om[j], correction, om[j], zero);
                    for (uint i = 0; i < KEYS / 8; i++) {
                        simdgroup_float8x8 v;
                        simdgroup_load(v, stage + 8 * i * HEAD_MAX + 8 * j, HEAD_MAX);
                        simdgroup_multiply_accumulate(om[j], pm[i], v, om[j]);
                    }
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);  // the next keys overwrite the values
        }
    }

    // Each 8x8 block of the output through the simdgroup's scratch, divided by its row's sum.
    for (uint j = 0; j < (head_dim + 7) / 8; j++) {
        simdgroup_store(om[j], my_diag, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = lane; e < 64; e += 32) {
            uint r = e / 8, d = 8 * j + e % 8, t = t0 + 8 * simd + r;
            if (t < n_tokens && d < head_dim) out[(ulong(t) * n_heads + h) * head_dim + d] = my_diag[e] / l[r];
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the scratch
    }
}

// The grid is (n_tokens / FA_ROWS rounded up, n_heads), FA_SIMDS simdgroups of 32 each.
#define FLASH_ATTENTION(NAME, T, HEAD_MAX)                                                                      \
    kernel void flash_attention_##NAME##_##HEAD_MAX(                                                            \
        device const float* q [[buffer(0)]], device const T* k_cache [[buffer(1)]],                            \
        device const T* v_cache [[buffer(2)]], device const uint* positions [[buffer(3)]],                     \
        device const uint* tables [[buffer(4)]], constant uint& table_width [[buffer(5)]],                     \
        device const uint* token_seqs [[buffer(6)]], constant uint& page_size [[buffer(7)]],                   \
        device float* out [[buffer(8)]], constant uint& n_tokens [[buffer(9)]], constant uint& n_heads [[buffer(10)]], \
        constant uint& n_kv_heads [[buffer(11)]], constant uint& head_dim [[buffer(12)]],                      \
        constant float& scale [[buffer(13)]], constant float& softcap [[buffer(14)]],                          \
        constant uint& window [[buffer(15)]], uint2 tile [[threadgroup_position_in_grid]],                     \
        uint tid [[thread_index_in_threadgroup]], uint2 group_size [[threads_per_threadgroup]],                \
        uint simd [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {               \
        threadgroup float stage[FA_STAGE];                                                                      \
        threadgroup float scores[FA_SIMDS * 8 * FA_MAX_KEYS];                                                   \
        threadgroup float diag[FA_SIMDS * 64];                                                                  \
        threadgroup uint row_seq[FA_ROWS];                                                                      \
        threadgroup uint row_pos[FA_ROWS];                                                                      \
        threadgroup uint row_lo[FA_ROWS];                                                                       \
        flash_attention_tile<T, HEAD_MAX>(q, k_cache, v_cache, positions, tables, table_width, token_seqs,     \
                                          page_size, out, n_tokens, n_heads, n_kv_heads, head_dim, scale, softcap, \
                                          window, tile, tid, group_size.x, simd, lane, stage, scores, diag,     \
                                          row_seq, row_pos, row_lo);                                            \
    }

FLASH_ATTENTION(f16, half, 64)
FLASH_ATTENTION(f16, half, 128)
FLASH_ATTENTION(f16, half, 256)
FLASH_ATTENTION(f32, float, 64)
FLASH_ATTENTION(f32, float, 128)
FLASH_ATTENTION(f32, float, 256)
