// Causal attention for prefill on tensor cores, flash-attention style: no score matrix in memory. A
// block takes one head and a tile of consecutive query tokens of one sequence (the host lists the
// tiles: `tiles` holds (first token, count) pairs); each of its 4 warps owns GROUPS groups of 16
// query rows. Two groups (tiles of 128) share every key and value fragment the warp loads: half the
// fragment loads and about a quarter fewer instructions an MMA than one (tiles of 64, for steps too
// short to fill the GPU with the larger). The queries wait in shared memory as f16. Keys and values
// stream through shared memory 32 positions at a time, in two buffers: cp.async copies the next
// tile while the warps work on this one. S = Q K^T and O += P V are m16n8k16 f16 MMAs with f32
// accumulation, their fragments read by ldmatrix (transposing, for V); the softmax is online, in
// base 2, with the scale folded into Q (and a soft cap, where the layer has one, applied to S in
// those units). Only the key tiles that reach past a warp's first query, or before its last query's
// window, are masked; a warp skips those past its last query or wholly before its first query's
// window, and a block starts at the tile of its first query's window. Blocks are numbered heads first, last tile first,
// so that the longest ones start first and the short ones fill the tail. f16 KV cache; head_dim 64
// or 128. The output goes out in f32, or in the f16 or bf16 (`out_type`) that the output
// projection's GEMM reads. With `turns` (rope_kv_write's angles for each token, every dimension
// rotated, pairs as `pairing` says), the queries come unrotated and are rotated here as they are
// loaded: prefill's queries then make one trip through memory instead of three. On Hopper,
// flash_attention_wg.cu does the same on the warpgroup MMAs, with this file's helpers.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * g + c): A holds rows g and g + 8, columns
// 2c, 2c + 1 and 2c + 8, 2c + 9; B holds column g, rows 2c, 2c + 1 and 2c + 8, 2c + 9; the f32
// C holds rows g and g + 8, columns 2c and 2c + 1. S's C layout is exactly P's A layout, so the
// probabilities go from one MMA to the next without leaving registers.
#define FA_WARPS 4
#define FA_KEYS 32

// 2^x by the hardware's approximation alone (exp2f adds a rescaling for results below f32's
// normal range, which a probability there does not need): a few instructions less per score.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The sum (or max) over the 4 lanes that share a row.
__device__ __forceinline__ float row_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float row_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// How far (in log2 units) a row's scores may rise above the base its exponentials are taken
// against before the sums are rescaled: probabilities up to 2^8 are still exact enough in f16 and
// far from its range, and a rescale (a multiply of every output value) becomes rare after a
// row's first keys.
#define FA_RESCALE_ABOVE 8.0f
#define FA_NEG_INF __int_as_float(0xff800000u)
#define FA_LOG2E 1.4426950408889634f

// How the queries' dimensions pair for RoPE (`pairing`): not rotated here, adjacent (2i, 2i + 1),
// or halves apart (i, i + D/2); each load of the queries is compiled apart (Constant).
#define FA_NOT_ROTATED 0
#define FA_ADJACENT 1
#define FA_HALVES 2

// The rotated pair of dimensions d, d + 1 (d even) of a query row, scaled, as two f16.
template <int D, int ROTATION>
__device__ __forceinline__ u32 query_pair(const float* row, const float2* angles, int d, float scale) {
    constexpr int HALF = D / 2;
    float2 x = *(const float2*)(row + d), v = x;
    if (ROTATION == FA_ADJACENT) {
        float2 cs = angles[d / 2];
        v = make_float2(x.x * cs.x - x.y * cs.y, x.x * cs.y + x.y * cs.x);
    } else if (ROTATION == FA_HALVES) {
        bool first_half = d < HALF;
        int i = first_half ? d : d - HALF;
        float2 y = *(const float2*)(row + (first_half ? d + HALF : d - HALF));
        float4 cs = *(const float4*)(angles + i);  // pairs i and i + 1
        v = first_half ? make_float2(x.x * cs.x - y.x * cs.y, x.y * cs.z - y.y * cs.w)
                       : make_float2(y.x * cs.y + x.x * cs.x, y.y * cs.w + x.y * cs.z);
    }
    return pack_f16(v.x * scale, v.y * scale);
}

// Where a block's query rows come from: row r of a tile of consecutive tokens of one head h is
// token first + r's query of that head.
struct TileQueries {
    u32 first;
    int n_heads, h;
    // Row r's row of q (a token's head), and its token (whose angles rotate it).
    __device__ __forceinline__ u64 operator()(int r, u64* token) const {
        *token = first + r;
        return *token * n_heads + h;
    }
};

// A lane's query rows (rows g and g + 8 of each of its warp's GROUPS groups of 16) go to shared
// memory as f16, scaled, rotated where `turns` is given: dimensions d, d + 1 and d + 8, d + 9 of
// each 16, d = 2c, each pair to `at(row, d)`; `query_of` (as TileQueries) says where each row's
// query is. A row past the tile (row_pos -1) reads the tile's first and is zeroed, so that the
// loads need no branch. (The loops over a lane's rows are unrolled here and in the kernels, so that
// rows, row_pos and the outputs are indexed by constants: a run-time index would put them in local
// memory.)
template <int D, int GROUPS, typename QueryOf, typename At>
__device__ __forceinline__ void load_queries(const float* q, const float2* turns, int pairing,
                                             const int (&rows)[GROUPS][2], const int (&row_pos)[GROUPS][2],
                                             QueryOf query_of, int c, float score_scale, At at) {
    const float scale = score_scale * FA_LOG2E;
    auto load = [&](auto rotation) {
        constexpr int R = decltype(rotation)::value;
#pragma unroll
        for (int gr = 0; gr < GROUPS; gr++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                bool valid = row_pos[gr][r] >= 0;
                u64 token;
                const float* row = q + query_of(valid ? rows[gr][r] : 0, &token) * D;
                const float2* angles = R == FA_NOT_ROTATED ? nullptr : turns + token * (D / 2);
#pragma unroll
                for (int d = 2 * c; d < D; d += 8) {
                    u32 pair = query_pair<D, R>(row, angles, d, scale);
                    *at(rows[gr][r], d) = valid ? pair : 0u;
                }
            }
    };
    if (!turns || pairing == FA_NOT_ROTATED)
        load(Constant<FA_NOT_ROTATED>{});
    else if (pairing == FA_ADJACENT)
        load(Constant<FA_ADJACENT>{});
    else
        load(Constant<FA_HALVES>{});
}

// One tile of KEYS keys through the online softmax: S's scores (in the MMA's C layout, keys
// kt.., in log2 units) capped to cap * tanh(s / cap) where `cap` (the soft cap in those units) is
// not 0, masked where `masked` says a key may be later than a row or before its window (`window`
// positions up to the row's own; 0: no window), each row's base raised where its
// scores pass it by FA_RESCALE_ABOVE (the sums and outputs so far rescaled, for the whole warp at
// once), and the probabilities packed as the A fragments of O += P V (S's C layout is P's A
// layout). A row that has seen nothing stays at zero.
template <int GROUPS, int KEYS, int D>
__device__ __forceinline__ void online_softmax(float (&s)[GROUPS][KEYS / 8][4], float (&m)[GROUPS][2],
                                               float (&l)[GROUPS][2], float (&o)[GROUPS][D / 8][4],
                                               u32 (&pa)[GROUPS][KEYS / 16][4], bool masked, int kt, int c,
                                               const int (&row_pos)[GROUPS][2], float cap, int window) {
    const float NEG_INF = FA_NEG_INF;
    if (cap != 0.0f)
        for (int gr = 0; gr < GROUPS; gr++)
            for (int j = 0; j < KEYS / 8; j++)
                for (int e = 0; e < 4; e++) s[gr][j][e] = cap * tanhf(s[gr][j][e] / cap);
    // The mask as a branch of its own: made per value, its tests ran in every tile.
    if (masked) {
        for (int gr = 0; gr < GROUPS; gr++)
            for (int j = 0; j < KEYS / 8; j++)
                for (int e = 0; e < 4; e++) {
                    int key = kt + 8 * j + 2 * c + e % 2, pos = row_pos[gr][e / 2];
                    if (key > pos || (window > 0 && pos - key >= window)) s[gr][j][e] = NEG_INF;
                }
    }
    float tile_max[GROUPS][2];
    bool rises = false;
    for (int gr = 0; gr < GROUPS; gr++) {
        tile_max[gr][0] = tile_max[gr][1] = NEG_INF;
        for (int j = 0; j < KEYS / 8; j++)
            for (int e = 0; e < 4; e++) tile_max[gr][e / 2] = fmaxf(tile_max[gr][e / 2], s[gr][j][e]);
        for (int r = 0; r < 2; r++) {
            tile_max[gr][r] = row_max(tile_max[gr][r]);
            rises |= tile_max[gr][r] > m[gr][r] + FA_RESCALE_ABOVE;
        }
    }
    if (__any_sync(0xffffffffu, rises)) {
        for (int gr = 0; gr < GROUPS; gr++) {
            float correction[2];
            for (int r = 0; r < 2; r++) {
                float m_new = fmaxf(m[gr][r], tile_max[gr][r]);
                // 0 for a row's first keys (from -inf); a row still without any stays at zero.
                correction[r] = m_new == NEG_INF ? 1.0f : fast_exp2(m[gr][r] - m_new);
                m[gr][r] = m_new;
                l[gr][r] *= correction[r];
            }
            for (int n = 0; n < D / 8; n++) {
                o[gr][n][0] *= correction[0];
                o[gr][n][1] *= correction[0];
                o[gr][n][2] *= correction[1];
                o[gr][n][3] *= correction[1];
            }
        }
    }
    for (int gr = 0; gr < GROUPS; gr++) {
        float base[2], partial[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; r++) base[r] = m[gr][r] == NEG_INF ? 0.0f : m[gr][r];
        for (int j = 0; j < KEYS / 8; j++)
            for (int e = 0; e < 4; e++) {
                s[gr][j][e] = fast_exp2(s[gr][j][e] - base[e / 2]);
                partial[e / 2] += s[gr][j][e];
            }
        for (int r = 0; r < 2; r++) l[gr][r] += partial[r];
        for (int kk = 0; kk < KEYS / 16; kk++) {
            pa[gr][kk][0] = pack_f16(s[gr][2 * kk][0], s[gr][2 * kk][1]);
            pa[gr][kk][1] = pack_f16(s[gr][2 * kk][2], s[gr][2 * kk][3]);
            pa[gr][kk][2] = pack_f16(s[gr][2 * kk + 1][0], s[gr][2 * kk + 1][1]);
            pa[gr][kk][3] = pack_f16(s[gr][2 * kk + 1][2], s[gr][2 * kk + 1][3]);
        }
    }
}

// A lane's output rows, divided by their sums, as f32 or as the 16-bit `out_type`, each where
// `query_of` says its query came from.
template <int GROUPS, int D, typename QueryOf>
__device__ __forceinline__ void store_rows(const float (&o)[GROUPS][D / 8][4], const float (&l)[GROUPS][2],
                                           const int (&rows)[GROUPS][2], const int (&row_pos)[GROUPS][2],
                                           QueryOf query_of, int c, void* out, int out_type) {
#pragma unroll
    for (int gr = 0; gr < GROUPS; gr++) {
        float total[2] = {row_sum(l[gr][0]), row_sum(l[gr][1])};  // every lane shuffles, before any leaves
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (row_pos[gr][r] < 0) continue;
            u64 token, at = query_of(rows[gr][r], &token) * D + 2 * c;
            float inv = 1.0f / total[r];
            if (out_type == TY_F32) {
                for (int n = 0; n < D / 8; n++)
                    *(float2*)((float*)out + at + 8 * n) =
                        make_float2(o[gr][n][2 * r] * inv, o[gr][n][2 * r + 1] * inv);
            } else {
                for (int n = 0; n < D / 8; n++)
                    *(u32*)((u16*)out + at + 8 * n) = to_16bit(o[gr][n][2 * r] * inv, out_type) |
                                                      (u32)to_16bit(o[gr][n][2 * r + 1] * inv, out_type) << 16;
            }
        }
    }
}

// A lane's rows (g and g + 8 of each of the GROUPS groups of 16 from `warp_first`) and their
// positions (-1: past the tile, sees nothing). Positions are far below 2^31.
template <int GROUPS>
__device__ __forceinline__ void lane_rows(int (&rows)[GROUPS][2], int (&row_pos)[GROUPS][2], int warp_first, int g,
                                          u32 pos0, u32 count) {
    for (int gr = 0; gr < GROUPS; gr++)
        for (int r = 0; r < 2; r++) {
            rows[gr][r] = warp_first + 16 * gr + 8 * r + g;
            row_pos[gr][r] = rows[gr][r] < (int)count ? (int)(pos0 + rows[gr][r]) : -1;
        }
}

// The loop over a block's key tiles of KEYS keys from `key0` (a multiple of KEYS), two shared
// buffers in turn: the next tile's
// keys and values are copied from the paged cache while `work(kt, buffer)` runs on this one,
// between two barriers. A thread copies the same 16-byte chunk of the head for keys copy_key,
// copy_key + STEP, ...: the first to `chunk_at(copy_key, chunk)` bytes into a buffer, each next
// `STEP * row_bytes` further. The cache rows of its next keys are looked up a tile before the
// copies, so that the table's loads have a tile's work to arrive in (a layer's cache has far
// fewer than 2^32 rows); keys past the last are zeros. ASYNC_PROXY: wgmma reads the tiles.
template <int D, int KEYS, int THREADS, bool ASYNC_PROXY, typename ChunkAt, typename Work>
__device__ __forceinline__ void over_key_tiles(const u16* k_cache, const u16* v_cache, const u32* table, int page_size,
                                               u32 key0, u32 n_keys, int kv_width, int kv_off, u32 k_shared,
                                               u32 v_shared,
                                               u32 buffer_bytes, u32 row_bytes, ChunkAt chunk_at, Work work) {
    constexpr int CHUNKS = D / 8, STEP = THREADS / CHUNKS, COPIES = KEYS / STEP;
    const u32 copy_key = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const u32 copy_to = chunk_at(copy_key, chunk);
    const u16* k_from = k_cache + kv_off + 8 * chunk;
    const u16* v_from = v_cache + kv_off + 8 * chunk;
    u32 cache_rows[COPIES];
    auto look_up = [&](u32 kt) {
        for (int i = 0; i < COPIES; i++) {
            u32 p = kt + copy_key + i * STEP;
            cache_rows[i] = (u32)page_row(table, page_size, p < n_keys ? p : 0);
        }
    };
    auto stage = [&](u32 buf, u32 kt) {
        for (int i = 0; i < COPIES; i++) {
            bool valid = kt + copy_key + i * STEP < n_keys;
            u32 to = buf * buffer_bytes + copy_to + i * STEP * row_bytes;
            u64 at = (u64)cache_rows[i] * kv_width;
            copy_async16(k_shared + to, k_from + at, valid);
            copy_async16(v_shared + to, v_from + at, valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    look_up(key0);
    stage(0, key0);
    look_up(key0 + KEYS);
    for (u32 kt = key0, buf = 0; kt < n_keys; kt += KEYS, buf ^= 1) {
        // The next tile's copies go out (an empty group after the last), then this tile's are
        // awaited.
        if (kt + KEYS < n_keys) {
            stage(buf ^ 1, kt + KEYS);
            look_up(kt + 2 * KEYS);
        } else
            asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        // Copies (and the queries' stores) go through the generic proxy; wgmma reads through the
        // async one.
        if (ASYNC_PROXY) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        work(kt, buf);
        __syncthreads();
    }
}

// A block's tile of queries (grid: heads, then tiles from the last, see the host) and where its
// keys are: the tile's queries see positions below n_keys of its sequence's cache, none before
// key0 (the tile of KEYS keys where the first query's window starts).
struct QueryTile {
    int h;
    u32 first, count, pos0, key0, n_keys;
    const u32* table;
    int kv_width, kv_off;
};
template <int D, int KEYS>
__device__ __forceinline__ QueryTile query_tile(const u32* tiles, const u32* positions, const u32* tables,
                                                int table_width, const u32* token_seqs, int n_heads, int n_kv_heads,
                                                int window) {
    QueryTile t;
    t.h = blockIdx.x;
    int tile = gridDim.y - 1 - blockIdx.y;
    t.first = tiles[2 * tile], t.count = tiles[2 * tile + 1];
    t.pos0 = positions[t.first];
    t.n_keys = t.pos0 + t.count;
    u32 seen_from = window > 0 && t.pos0 + 1 > (u32)window ? t.pos0 + 1 - window : 0;
    t.key0 = seen_from / KEYS * KEYS;
    t.table = tables + (u64)token_seqs[t.first] * table_width;
    t.kv_width = n_kv_heads * D, t.kv_off = (t.h / (n_heads / n_kv_heads)) * D;
    return t;
}

// The device functions' parameters, and FlashAttentionParams' fields as their arguments.
#define FLASH_ATTENTION_PARAMS                                                                                 \
    const float* q, const u16* k_cache, const u16* v_cache, const u32* positions, const u32* tables,          \
        int table_width, const u32* token_seqs, int page_size, const u32* tiles, const float2* turns, int pairing, \
        void* out, int out_type, int n_heads, int n_kv_heads, float scale, float softcap, int window
#define FLASH_ATTENTION_ARGS                                                                                     \
    p.q, p.k_cache, p.v_cache, p.positions, p.tables, p.table_width, p.token_seqs, p.page_size, p.tiles, p.turns, \
        p.pairing, p.out, p.out_type, p.n_heads, p.n_kv_heads, p.scale, p.softcap, p.window
// The kernel NAME_D_N, NAME<D, N> on its FlashAttentionParams under launch bounds of THREADS and BLOCKS.
#define FLASH_ATTENTION_KERNEL(NAME, D, N, THREADS, BLOCKS)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS) NAME##_##D##_##N(FlashAttentionParams p) {  \
        NAME<D, N>(FLASH_ATTENTION_ARGS);                                                                      \
    }

template <int D, int GROUPS>
__device__ void flash_attention(FLASH_ATTENTION_PARAMS) {
    // Rows padded by 16 bytes, so that ldmatrix's eight rows fall in distinct banks. Shared memory
    // is addressed by 32-bit offsets from these bases, the constant parts folded into immediates:
    // two buffers of keys, two of values, then the block's queries (FlashBlocks::shared).
    constexpr u32 ROW = (D + 8) * 2, BUFFER = FA_KEYS * ROW;  // bytes
    constexpr int ROWS = 16 * GROUPS;                        // query rows a warp
    extern __shared__ __align__(16) u8 fa_shared[];
    const u32 k_shared = shared_address(fa_shared), v_shared = k_shared + 2 * BUFFER, q_shared = v_shared + 2 * BUFFER;
    begin_after_inputs();
    const QueryTile t =
        query_tile<D, FA_KEYS>(tiles, positions, tables, table_width, token_seqs, n_heads, n_kv_heads, window);
    const u32 first = t.first, count = t.count, pos0 = t.pos0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

    const int warp_first = ROWS * warp;
    int rows[GROUPS][2], row_pos[GROUPS][2];
    lane_rows(rows, row_pos, warp_first, g, pos0, count);
    // The warp's last query position: later key tiles are all masked for it and skipped (-1: all
    // its rows are past the tile).
    const int warp_last = warp_first < (int)count ? (int)pos0 + min(warp_first + ROWS, (int)count) - 1 : -1;
    const float cap = softcap * FA_LOG2E;  // S is in log2 units
    const TileQueries queries{first, n_heads, t.h};
    load_queries<D>(q, turns, pairing, rows, row_pos, queries, c, scale,
                    [&](int row, int d) { return (u32*)(fa_shared + 4 * BUFFER + row * ROW) + d / 2; });
    // (The loop's first barrier makes them visible to the warp's ldmatrix.)

    float o[GROUPS][D / 8][4];
    for (int gr = 0; gr < GROUPS; gr++)
        for (int n = 0; n < D / 8; n++) o[gr][n][0] = o[gr][n][1] = o[gr][n][2] = o[gr][n][3] = 0.0f;
    // m: the base of each row's exponentials (at most FA_RESCALE_ABOVE below its largest score).
    float m[GROUPS][2], l[GROUPS][2];
    for (int gr = 0; gr < GROUPS; gr++) m[gr][0] = m[gr][1] = FA_NEG_INF, l[gr][0] = l[gr][1] = 0.0f;
    // Where this lane's ldmatrix rows start: keys (lane % 8) at dimensions 8 (lane / 8).., for
    // S; keys 8 (lane / 8 % 2) + lane % 8 at dimensions 8 (lane / 16).., for V (transposed); the
    // warp's query rows lane % 16 at dimensions 8 (lane / 16).., for Q (A fragments).
    const u32 k_lane = k_shared + (lane % 8) * ROW + 16 * (lane / 8);
    const u32 v_lane = v_shared + (8 * (lane / 8 % 2) + lane % 8) * ROW + 16 * (lane / 16);
    const u32 q_lane = q_shared + (warp_first + lane % 16) * ROW + 16 * (lane / 16);
    over_key_tiles<D, FA_KEYS, FA_WARPS * 32, false>(
        k_cache, v_cache, t.table, page_size, t.key0, t.n_keys, t.kv_width, t.kv_off, k_shared, v_shared, BUFFER,
        ROW, [](u32 key, u32 chunk) { return key * ROW + 16 * chunk; }, [&](u32 kt, u32 buf) {
            if ((int)kt > warp_last) return;  // every key here is later than the warp's rows
            // every key here is before the warp's first row's window
            if (window > 0 && (int)(pos0 + warp_first) - (int)(kt + FA_KEYS - 1) >= window) return;
            // some key here is later than a row, or before a row's window
            bool masked = kt + FA_KEYS > pos0 + warp_first || (window > 0 && warp_last - (int)kt >= window);

            // S = Q K^T for this warp's rows and the tile's keys: dimensions outside, keys and
            // groups inside, so that the MMAs next to each other accumulate into different tiles.
            float s[GROUPS][FA_KEYS / 8][4];
            for (int gr = 0; gr < GROUPS; gr++)
                for (int j = 0; j < FA_KEYS / 8; j++) s[gr][j][0] = s[gr][j][1] = s[gr][j][2] = s[gr][j][3] = 0.0f;
            // The fragments of the next dimensions load while these multiply: keys 8j.. against
            // dimensions 16 st.. and 16 (st + 1).. (two MMAs' B fragments), and each group's
            // queries at 16 st.. and 16 (st + 1)...
            const u32 k_tile = k_lane + buf * BUFFER;
            u32 kf[2][FA_KEYS / 8][4], qf[2][GROUPS][2][4];
            auto load_step = [&](int i, int st) {
                for (int j = 0; j < FA_KEYS / 8; j++) load_tiles<false>(kf[i][j], k_tile + 8 * j * ROW + 32 * st);
                for (int gr = 0; gr < GROUPS; gr++)
                    for (int t = 0; t < 2; t++) load_tiles<false>(qf[i][gr][t], q_lane + 16 * gr * ROW + 32 * (st + t));
            };
            load_step(0, 0);
#pragma unroll
            for (int st = 0; st < D / 16; st += 2) {
                const int i = st / 2 % 2;
                if (st + 2 < D / 16) load_step(i ^ 1, st + 2);
                for (int t = 0; t < 2; t++)
                    for (int gr = 0; gr < GROUPS; gr++)
                        for (int j = 0; j < FA_KEYS / 8; j++)
                            mma_f16(s[gr][j], qf[i][gr][t], kf[i][j][2 * t], kf[i][j][2 * t + 1]);
            }
            u32 pa[GROUPS][FA_KEYS / 16][4];
            online_softmax<GROUPS, FA_KEYS, D>(s, m, l, o, pa, masked, (int)kt, c, row_pos, cap, window);

            // O += P V, P straight from S's registers; each step's V fragments load during the step
            // before and serve every group. Step i: keys 16 kk.. (then 16 kk + 8..) against
            // dimensions 8n.. and 8 (n + 1)...
            constexpr int V_STEPS = FA_KEYS / 16 * (D / 16);
            const u32 v_tile = v_lane + buf * BUFFER;
            auto load_values = [&](u32* f, int i) {
                load_tiles<true>(f, v_tile + i / (D / 16) * 16 * ROW + i % (D / 16) * 32);
            };
            u32 vf[2][4];
            load_values(vf[0], 0);
#pragma unroll
            for (int i = 0; i < V_STEPS; i++) {
                if (i + 1 < V_STEPS) load_values(vf[(i + 1) % 2], i + 1);
                int kk = i / (D / 16), n = 2 * (i % (D / 16));
                for (int gr = 0; gr < GROUPS; gr++) {
                    mma_f16(o[gr][n], pa[gr][kk], vf[i % 2][0], vf[i % 2][1]);
                    mma_f16(o[gr][n + 1], pa[gr][kk], vf[i % 2][2], vf[i % 2][3]);
                }
            }
        });

    store_rows<GROUPS, D>(o, l, rows, row_pos, queries, c, out, out_type);
}

// Three blocks a multiprocessor of one group a warp, two of two (a thread then holds 64 output
// values a group, heads of 128).
#define FLASH_ATTENTION(D, GROUPS) \
    FLASH_ATTENTION_KERNEL(flash_attention, D, GROUPS, FA_WARPS * 32, GROUPS == 1 ? 3 : 2)
FLASH_ATTENTION(64, 1)
FLASH_ATTENTION(64, 2)
FLASH_ATTENTION(128, 1)
FLASH_ATTENTION(128, 2)
