// Flash attention on Hopper's warpgroup MMAs (wgmma; compiled only for sm_90a): the computation of
// flash_attention.cu, sharing its query loads, online softmax and stores, with a warpgroup (four
// warps) for each 64 query rows and WGS warpgroups a block. S = Q K^T reads both operands from
// shared memory; O += P V takes P from registers (S's accumulator layout is the A operand's, as with
// mma.sync) and V from shared memory. One instruction takes 64 rows by 64 keys over 16 dimensions
// (S), or 64 rows by the whole head over 16 keys (P V), where mma.sync takes 16 by 8 by 16, so a
// long prompt's attention issues far fewer instructions.
//
// Shared memory holds every tile in wgmma's 128-byte swizzled layout: panels of 64 dimensions (128
// bytes a row), rows in groups of eight (1024 bytes), the 16-byte chunk c of row r stored at chunk
// c ^ (r % 8), so that the eight rows of a core matrix fall in distinct banks. Queries are K-major
// A (dimensions contiguous), keys K-major B, values MN-major B (dimensions contiguous, keys
// strided): the descriptors below say which.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FW_KEYS 64

__device__ __forceinline__ u32 swizzled(u32 row, u32 chunk) { return row * 128 + ((chunk ^ (row % 8)) << 4); }

// A shared-memory matrix descriptor for the 128-byte swizzle: the start address, the byte offset
// between 64-element panels along M or N for an MN-major operand (`panels`; unused for K-major),
// and 1024 bytes between groups of eight rows.
__device__ __forceinline__ u64 matrix_descriptor(u32 address, u32 panels) {
    return (u64)((address & 0x3ffff) >> 4) | (u64)(panels >> 4) << 16 | (u64)(1024 >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving reads or writes of accumulators across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N][4]) {
    for (int i = 0; i < N; i++)
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e])::"memory");
}

// The asm operands of a thread's N accumulators, d[i][e].
#define ACCUMULATOR_ROW(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define ACCUMULATORS_16 ACCUMULATOR_ROW(0), ACCUMULATOR_ROW(1), ACCUMULATOR_ROW(2), ACCUMULATOR_ROW(3)
#define ACCUMULATORS_32 \
    ACCUMULATORS_16, ACCUMULATOR_ROW(4), ACCUMULATOR_ROW(5), ACCUMULATOR_ROW(6), ACCUMULATOR_ROW(7)
#define ACCUMULATORS_64                                                                                     \
    ACCUMULATORS_32, ACCUMULATOR_ROW(8), ACCUMULATOR_ROW(9), ACCUMULATOR_ROW(10), ACCUMULATOR_ROW(11), \
        ACCUMULATOR_ROW(12), ACCUMULATOR_ROW(13), ACCUMULATOR_ROW(14), ACCUMULATOR_ROW(15)

// D (64 x N, f32) += A B over 16 of K, A and B f16: from shared memory (ss: both described) or
// A from registers (rs). `accumulate` 0 overwrites D. Values are transposed (the last 1 of rs).
__device__ __forceinline__ void wgmma_ss_64(float (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, 0, 0; }"
                 : ACCUMULATORS_32
                 : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_64(float (&d)[8][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
                 : ACCUMULATORS_32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_128(float (&d)[16][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
                 : ACCUMULATORS_64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

template <int D, int N>
__device__ __forceinline__ void wgmma_values(float (&o)[N][4], const u32 (&p)[4], u64 v) {
    if constexpr (D == 64)
        wgmma_rs_64(o, p, v, 1);
    else
        wgmma_rs_128(o, p, v, 1);
}

template <int D, int WGS>
__device__ void flash_attention_wg(FLASH_ATTENTION_PARAMS) {
    // Bytes: a panel of the block's queries, of a key or value tile, and a whole tile.
    constexpr int ROWS = 64 * WGS, PANELS = D / 64;
    constexpr u32 Q_PANEL = ROWS * 128, KV_PANEL = FW_KEYS * 128, KV_TILE = PANELS * KV_PANEL;
    // The swizzle needs 1024-byte alignment; the host adds 1024 bytes to align the base up.
    extern __shared__ __align__(16) u8 fw_shared[];
    const u32 unaligned = shared_address(fw_shared), q_shared = (unaligned + 1023) & ~1023u;
    const u32 k_shared = q_shared + PANELS * Q_PANEL, v_shared = k_shared + 2 * KV_TILE;
    u8* const q_generic = fw_shared + (q_shared - unaligned);
    begin_after_inputs();
    const QueryTile t =
        query_tile<D, FW_KEYS>(tiles, positions, tables, table_width, token_seqs, n_heads, n_kv_heads, window);
    const u32 pos0 = t.pos0, count = t.count;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

    // Warp w holds the tile's query rows 16w..16w + 15 in its warpgroup's accumulators, which
    // hold rows 64 (w / 4)...
    const int warp_first = 16 * warp, group_first = 64 * (warp / 4);
    int rows[1][2], row_pos[1][2];
    lane_rows(rows, row_pos, warp_first, g, pos0, count);
    // The warpgroup's last query position: it skips later key tiles, all masked for it.
    const int group_last =
        group_first < (int)count ? (int)pos0 + min(group_first + 64, (int)count) - 1 : -1;
    const float cap = softcap * FA_LOG2E;  // S is in log2 units
    const TileQueries queries{t.first, n_heads, t.h};
    load_queries<D>(q, turns, pairing, rows, row_pos, queries, c, scale, [&](int row, int d) {
        return (u32*)(q_generic + d / 64 * Q_PANEL + swizzled(row, d % 64 / 8) + d % 8 * 2);
    });

    float o[1][D / 8][4];
    for (int n = 0; n < D / 8; n++) o[0][n][0] = o[0][n][1] = o[0][n][2] = o[0][n][3] = 0.0f;
    float m[1][2] = {{FA_NEG_INF, FA_NEG_INF}}, l[1][2] = {{0.0f, 0.0f}};

    // The copies' steps are a multiple of 8 keys, so a chunk's swizzled offset moves by whole rows.
    over_key_tiles<D, FW_KEYS, WGS * 128, true>(
        k_cache, v_cache, t.table, page_size, t.key0, t.n_keys, t.kv_width, t.kv_off, k_shared, v_shared, KV_TILE,
        128, [](u32 key, u32 chunk) { return chunk / 8 * KV_PANEL + swizzled(key, chunk % 8); },
        [&](u32 kt, u32 buf) {
            // Skipped by the whole warpgroup (its MMAs are collective): every key here is later
            // than its rows, or before its first row's window.
            if ((int)kt > group_last) return;
            if (window > 0 && (int)(pos0 + group_first) - (int)(kt + FW_KEYS - 1) >= window) return;
            // Masked by the warp (the group's last row stands for the warp's: at worst a tile
            // more is masked).
            bool masked = kt + FW_KEYS > pos0 + warp_first || (window > 0 && group_last - (int)kt >= window);
            float s[1][FW_KEYS / 8][4];
            const u32 k_tile = k_shared + buf * KV_TILE;
            wgmma_fence();
#pragma unroll
            for (int st = 0; st < D / 16; st++) {
                u64 a = matrix_descriptor(q_shared + st / 4 * Q_PANEL + group_first * 128 + st % 4 * 32, 0);
                u64 b = matrix_descriptor(k_tile + st / 4 * KV_PANEL + st % 4 * 32, 0);
                wgmma_ss_64(s[0], a, b, st > 0);
            }
            wgmma_commit();
            wgmma_wait();
            fence_registers(s[0]);
            u32 pa[1][FW_KEYS / 16][4];
            online_softmax<1, FW_KEYS, D>(s, m, l, o, pa, masked, (int)kt, c, row_pos, cap, window);
            fence_registers(o[0]);
            wgmma_fence();
            const u32 v_tile = v_shared + buf * KV_TILE;
#pragma unroll
            for (int kk = 0; kk < FW_KEYS / 16; kk++)
                wgmma_values<D>(o[0], pa[0][kk], matrix_descriptor(v_tile + kk * 16 * 128, KV_PANEL));
            wgmma_commit();
            wgmma_wait();
            fence_registers(o[0]);
        });

    store_rows<1, D>(o, l, rows, row_pos, queries, c, out, out_type);
}

// Two blocks a multiprocessor (128 registers a thread for blocks of two warpgroups).
#define FLASH_ATTENTION_WG(D, WGS) FLASH_ATTENTION_KERNEL(flash_attention_wg, D, WGS, WGS * 128, 2)
FLASH_ATTENTION_WG(64, 1)
FLASH_ATTENTION_WG(64, 2)
FLASH_ATTENTION_WG(128, 1)
FLASH_ATTENTION_WG(128, 2)
#endif
