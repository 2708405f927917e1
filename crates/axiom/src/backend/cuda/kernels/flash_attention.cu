// Causal attention for prefill on tensor cores, flash-attention style: no score matrix in memory.
// A block takes one head and a tile of up to 64 consecutive query tokens of one sequence (the
// host lists the tiles: `tiles` holds (first token, count) pairs); each of its 4 warps owns 16
// query rows. Keys and values stream through shared memory 32 positions at a time, in two
// buffers: cp.async copies the next tile while the warps work on this one. S = Q K^T and
// O += P V are m16n8k16 f16 MMAs with f32 accumulation, their B fragments read by ldmatrix
// (transposing, for V); the softmax is online, in base 2, with the scale folded into Q. Only the
// key tiles that reach past a block's first query are masked. Blocks are numbered heads first,
// last tile first, so that the longest ones start first and the short ones fill the tail. f16 KV
// cache; head_dim 64 or 128.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * g + c): A holds rows g and g + 8, columns
// 2c, 2c + 1 and 2c + 8, 2c + 9; B holds column g, rows 2c, 2c + 1 and 2c + 8, 2c + 9; the f32
// C holds rows g and g + 8, columns 2c and 2c + 1. S's C layout is exactly P's A layout, so the
// probabilities go from one MMA to the next without leaving registers.
#define FA_WARPS 4
#define FA_KEYS 32

__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory without passing through registers; zeros where !valid.
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

// Four 8x8 tiles of 16-bit values from shared memory, lane l giving the address of row l % 8 of
// tile l / 8; TRANSPOSE hands each lane its values as if the tiles were transposed.
template <bool TRANSPOSE>
__device__ __forceinline__ void load_tiles(u32* r, const u16* row) {
    if (TRANSPOSE)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared_address(row)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared_address(row)));
}

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

template <int D>
__device__ void flash_attention(const float* q, const u16* k_cache, const u16* v_cache, const u32* positions,
                                const u32* tables, int table_width, const u32* token_seqs, int page_size,
                                const u32* tiles, float* out, int n_heads, int n_kv_heads) {
    // Rows padded by 16 bytes, so that ldmatrix's eight rows fall in distinct banks.
    __shared__ __align__(16) u16 ks[2][FA_KEYS][D + 8];
    __shared__ __align__(16) u16 vs[2][FA_KEYS][D + 8];
    begin_after_inputs();
    const float NEG_INF = __int_as_float(0xff800000u);
    int h = blockIdx.x, tile = gridDim.y - 1 - blockIdx.y;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    u32 first = tiles[2 * tile], count = tiles[2 * tile + 1];
    u32 pos0 = positions[first];
    u32 n_keys = pos0 + count;  // the tile's last query sees positions 0..n_keys-1
    const u32* table = tables + (u64)token_seqs[first] * table_width;
    int kv_width = n_kv_heads * D, kv_off = (h / (n_heads / n_kv_heads)) * D;

    // This lane's rows of the tile, and their positions (-1: past the tile, sees nothing).
    int rows[2] = {16 * warp + g, 16 * warp + g + 8};
    int row_pos[2];  // (positions are far below 2^31)
    u32 qa[D / 16][4];
    const float scale = rsqrtf((float)D) * 1.4426950408889634f;  // 1/sqrt(D) * log2(e)
    for (int r = 0; r < 2; r++) row_pos[r] = rows[r] < (int)count ? (int)(pos0 + rows[r]) : -1;
    for (int s = 0; s < D / 16; s++) {
        for (int r = 0; r < 2; r++) {
            const float* qr = q + ((u64)(first + rows[r]) * n_heads + h) * D + 16 * s + 2 * c;
            bool valid = row_pos[r] >= 0;
            qa[s][r] = valid ? pack_f16(qr[0] * scale, qr[1] * scale) : 0u;
            qa[s][r + 2] = valid ? pack_f16(qr[8] * scale, qr[9] * scale) : 0u;
        }
    }

    float o[D / 8][4];
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    // Copies the keys and values of positions kt.. into buffer buf (zeros past the last one).
    auto stage = [&](int buf, u32 kt) {
        for (int i = threadIdx.x; i < FA_KEYS * (D / 8); i += FA_WARPS * 32) {
            int key = i / (D / 8), d8 = 8 * (i % (D / 8));
            bool valid = kt + key < n_keys;
            u64 at = valid ? page_row(table, page_size, kt + key) * kv_width + kv_off + d8 : 0;
            copy_async16(&ks[buf][key][d8], k_cache + at, valid);
            copy_async16(&vs[buf][key][d8], v_cache + at, valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    stage(0, 0);
    for (u32 kt = 0, buf = 0; kt < n_keys; kt += FA_KEYS, buf ^= 1) {
        // The next tile's copies go out (an empty group after the last), then this tile's are
        // awaited.
        if (kt + FA_KEYS < n_keys)
            stage(buf ^ 1, kt + FA_KEYS);
        else
            asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        bool masked = kt + FA_KEYS > pos0;  // some key here is later than the first query

        // S = Q K^T for this warp's 16 rows and the tile's keys, masked causally.
        float s[FA_KEYS / 8][4];
        float tile_max[2] = {NEG_INF, NEG_INF};
        for (int j = 0; j < FA_KEYS / 8; j++) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            for (int st = 0; st < D / 16; st += 2) {
                // Keys 8j.. against dimensions 16 st.. and 16 (st + 1)..: two MMAs' B fragments.
                u32 frag[4];
                load_tiles<false>(frag, &ks[buf][8 * j + lane % 8][16 * st + 8 * (lane / 8)]);
                mma_f16(s[j], qa[st], frag[0], frag[1]);
                mma_f16(s[j], qa[st + 1], frag[2], frag[3]);
            }
            int p = kt + 8 * j + 2 * c;
            for (int e = 0; e < 4; e++) {
                int r = e / 2;
                if (masked && p + (e % 2) > row_pos[r]) s[j][e] = NEG_INF;
                tile_max[r] = fmaxf(tile_max[r], s[j][e]);
            }
        }

        // Online softmax: rescale what was summed so far to the new maximum.
        float base[2], correction[2], partial[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; r++) {
            float m_new = fmaxf(m[r], row_max(tile_max[r]));
            base[r] = m_new == NEG_INF ? 0.0f : m_new;  // a row that has seen nothing stays at zero
            correction[r] = fast_exp2(m[r] - base[r]);
            m[r] = m_new;
        }
        for (int j = 0; j < FA_KEYS / 8; j++) {
            for (int e = 0; e < 4; e++) {
                s[j][e] = fast_exp2(s[j][e] - base[e / 2]);
                partial[e / 2] += s[j][e];
            }
        }
        for (int r = 0; r < 2; r++) l[r] = l[r] * correction[r] + partial[r];
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= correction[0];
            o[n][1] *= correction[0];
            o[n][2] *= correction[1];
            o[n][3] *= correction[1];
        }

        // O += P V, P straight from S's registers.
        for (int kk = 0; kk < FA_KEYS / 16; kk++) {
            u32 pa[4] = {pack_f16(s[2 * kk][0], s[2 * kk][1]), pack_f16(s[2 * kk][2], s[2 * kk][3]),
                         pack_f16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_f16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            for (int n = 0; n < D / 8; n += 2) {
                // Keys 16 kk.. (then 16 kk + 8..) against dimensions 8n.. and 8 (n + 1)...
                u32 frag[4];
                int quad = lane / 8;
                load_tiles<true>(frag, &vs[buf][16 * kk + 8 * (quad % 2) + lane % 8][8 * (n + quad / 2)]);
                mma_f16(o[n], pa, frag[0], frag[1]);
                mma_f16(o[n + 1], pa, frag[2], frag[3]);
            }
        }
        __syncthreads();
    }

    float total[2] = {row_sum(l[0]), row_sum(l[1])};  // every lane shuffles, before any leaves
    for (int r = 0; r < 2; r++) {
        if (row_pos[r] < 0) continue;
        float* orow = out + ((u64)(first + rows[r]) * n_heads + h) * D;
        for (int n = 0; n < D / 8; n++) {
            float2 v;
            v.x = o[n][2 * r] / total[r];
            v.y = o[n][2 * r + 1] / total[r];
            *(float2*)(orow + 8 * n + 2 * c) = v;
        }
    }
}

// Four blocks a multiprocessor: held to 128 registers, with a small spill, instead of 166 and three
// blocks (a layer of 2048 tokens on the H200: 225 -> 206 us).
#define FLASH_ATTENTION(D)                                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 4)                                               \
        flash_attention_##D(const float* q, const u16* k, const u16* v, const u32* positions, const u32* tables, \
                            int table_width, const u32* token_seqs, int page_size, const u32* tiles, float* out,  \
                            int n_heads, int n_kv_heads) {                                                       \
        flash_attention<D>(q, k, v, positions, tables, table_width, token_seqs, page_size, tiles, out, n_heads,  \
                           n_kv_heads);                                                                          \
    }
FLASH_ATTENTION(64)
FLASH_ATTENTION(128)
