// Flash attention for a step's query tiles of one token, as when sequences decode together
// (`tiles` holds them, (token, 1) pairs; cuda/flash_attention.rs gives the others to
// flash_attention.cu). There each query head would have a block of its own, a tile of one row:
// every sequence's keys and values read once for each head of a group that shares them, and one
// warp of four working through the whole context. Here a block takes one token and one KV head,
// with the query heads that share it (up to 16: blockIdx.z takes the next 16 of a larger group)
// as the rows of one MMA group, so each sequence's cache rows are read once per KV head; and its
// FD_WARPS warps split every tile of FD_KEYS keys, 16 keys each, each keeping its own online
// softmax, merged through shared memory at the end. Keys and values stream through shared memory
// as in flash_attention.cu, whose helpers (query rotation, masking, soft cap, windows, the online
// softmax) this kernel shares.
#define FD_WARPS 4
#define FD_KEYS (16 * FD_WARPS)

// Where the rows of a decode block come from: row r is head `head + r` of one token.
struct GroupQueries {
    u32 token;
    int n_heads, head;
    __device__ __forceinline__ u64 operator()(int r, u64* token_of) const {
        *token_of = token;
        return (u64)token * n_heads + head + r;
    }
};

template <int D>
__device__ void flash_decode(FLASH_ATTENTION_PARAMS) {
    // Two buffers of keys, two of values, then the 16 query rows; rows padded by 16 bytes.
    constexpr u32 ROW = (D + 8) * 2, BUFFER = FD_KEYS * ROW;  // bytes
    extern __shared__ __align__(16) u8 fd_shared[];
    const u32 k_shared = shared_address(fd_shared), v_shared = k_shared + 2 * BUFFER, q_shared = v_shared + 2 * BUFFER;
    begin_after_inputs();
    const int group = n_heads / n_kv_heads, kv_head = blockIdx.x, first_row = 16 * blockIdx.z;
    const u32 token = tiles[2 * blockIdx.y], pos = positions[token], n_keys = pos + 1;
    const u32 seen_from = window > 0 && n_keys > (u32)window ? n_keys - window : 0;
    const u32* table = tables + (u64)token_seqs[token] * table_width;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

    // Every warp holds the same rows, the group's heads from first_row (-1 past the group).
    int rows[1][2] = {{g, g + 8}}, row_pos[1][2];
    for (int r = 0; r < 2; r++) row_pos[0][r] = first_row + rows[0][r] < group ? (int)pos : -1;
    const GroupQueries queries{token, n_heads, kv_head * group + first_row};
    if (warp == 0)
        load_queries<D>(q, turns, pairing, rows, row_pos, queries, c, scale,
                        [&](int row, int d) { return (u32*)(fd_shared + 4 * BUFFER + row * ROW) + d / 2; });
    // (The key loop's first barrier makes them visible to every warp.)

    float o[1][D / 8][4];
    for (int n = 0; n < D / 8; n++) o[0][n][0] = o[0][n][1] = o[0][n][2] = o[0][n][3] = 0.0f;
    float m[1][2] = {{FA_NEG_INF, FA_NEG_INF}}, l[1][2] = {{0.0f, 0.0f}};
    const float cap = softcap * FA_LOG2E;
    // ldmatrix rows as in flash_attention.cu, the warp's keys 16 warp.. of each tile.
    const u32 k_lane = k_shared + (16 * warp + lane % 8) * ROW + 16 * (lane / 8);
    const u32 v_lane = v_shared + (16 * warp + 8 * (lane / 8 % 2) + lane % 8) * ROW + 16 * (lane / 16);
    const u32 q_lane = q_shared + (lane % 16) * ROW + 16 * (lane / 16);
    over_key_tiles<D, FD_KEYS, FD_WARPS * 32, false>(
        k_cache, v_cache, table, page_size, seen_from / FD_KEYS * FD_KEYS, n_keys, n_kv_heads * D, kv_head * D,
        k_shared, v_shared, BUFFER, ROW, [](u32 key, u32 chunk) { return key * ROW + 16 * chunk; },
        [&](u32 kt, u32 buf) {
            const int first_key = (int)kt + 16 * warp, last_key = first_key + 15;
            if (first_key > (int)pos || (window > 0 && (int)pos - last_key >= window)) return;  // none seen
            bool masked = last_key > (int)pos || (window > 0 && (int)pos - first_key >= window);

            // S = Q K^T for the warp's 16 keys, dimensions two steps of 16 at a time.
            float s[1][2][4] = {};
            const u32 k_tile = k_lane + buf * BUFFER;
#pragma unroll
            for (int st = 0; st < D / 16; st += 2) {
                u32 kf[2][4], qf[2][4];
                for (int j = 0; j < 2; j++) load_tiles<false>(kf[j], k_tile + 8 * j * ROW + 32 * st);
                for (int t = 0; t < 2; t++) load_tiles<false>(qf[t], q_lane + 32 * (st + t));
                for (int t = 0; t < 2; t++)
                    for (int j = 0; j < 2; j++) mma_f16(s[0][j], qf[t], kf[j][2 * t], kf[j][2 * t + 1]);
            }
            u32 pa[1][1][4];
            online_softmax<1, 16, D>(s, m, l, o, pa, masked, first_key, c, row_pos, cap, window);

            // O += P V over the warp's 16 keys, dimensions 16 at a time.
            const u32 v_tile = v_lane + buf * BUFFER;
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                u32 vf[4];
                load_tiles<true>(vf, v_tile + 16 * n);
                mma_f16(o[0][n], pa[0][0], vf[0], vf[1]);
                mma_f16(o[0][n + 1], pa[0][0], vf[2], vf[3]);
            }
        });

    // The merge: warps 1.. leave their state in the key buffers (free after the loop's last
    // barrier), each lane's values where the same lane of warp 0 reads them; warp 0 rescales every
    // state to the largest base of each row and adds them up.
    constexpr int VALUES = D / 2 + 4;  // a lane's outputs, its two bases and two partial sums
    float* states = (float*)fd_shared;
    if (warp > 0) {
        float* mine = states + ((warp - 1) * 32 + lane) * VALUES;
        for (int n = 0; n < D / 8; n++)
            for (int e = 0; e < 4; e++) mine[4 * n + e] = o[0][n][e];
        for (int r = 0; r < 2; r++) mine[D / 2 + r] = m[0][r], mine[D / 2 + 2 + r] = l[0][r];
    }
    __syncthreads();
    if (warp > 0) return;
    float base[2] = {m[0][0], m[0][1]};
    for (int w = 1; w < FD_WARPS; w++)
        for (int r = 0; r < 2; r++) base[r] = fmaxf(base[r], states[((w - 1) * 32 + lane) * VALUES + D / 2 + r]);
    // A state that has seen no key (base -inf) weighs nothing; a row past the group is never stored.
    auto weight = [&](float m_w, int r) { return m_w == FA_NEG_INF ? 0.0f : fast_exp2(m_w - base[r]); };
    float own[2] = {weight(m[0][0], 0), weight(m[0][1], 1)};
    for (int r = 0; r < 2; r++) l[0][r] *= own[r];
    for (int n = 0; n < D / 8; n++)
        for (int e = 0; e < 4; e++) o[0][n][e] *= own[e / 2];
    for (int w = 1; w < FD_WARPS; w++) {
        const float* theirs = states + ((w - 1) * 32 + lane) * VALUES;
        float scale_of[2];
        for (int r = 0; r < 2; r++) {
            scale_of[r] = weight(theirs[D / 2 + r], r);
            l[0][r] += theirs[D / 2 + 2 + r] * scale_of[r];
        }
        for (int n = 0; n < D / 8; n++)
            for (int e = 0; e < 4; e++) o[0][n][e] += theirs[4 * n + e] * scale_of[e / 2];
    }
    store_rows<1, D>(o, l, rows, row_pos, queries, c, out, out_type);
}

// Blocks of 128 threads, three a multiprocessor for heads of 128 (their buffers take ~74 KB).
#define FLASH_DECODE(D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(FD_WARPS * 32, 3) flash_decode_##D(FlashAttentionParams p) { \
        flash_decode<D>(FLASH_ATTENTION_ARGS);                                                              \
    }
FLASH_DECODE(64)
FLASH_DECODE(128)
