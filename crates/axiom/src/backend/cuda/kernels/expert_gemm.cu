// Expert products of steps long enough to group their pairs by expert (cuda/expert_gemm.rs), on the
// tensor cores: one launch computes every expert's product over its slots (group_pairs). A block
// takes a tile of EG_SLOTS consecutive slots of one expert (blockIdx.y; the tiles are found from the
// offsets on the device, so the host never learns the groups' sizes) and Tile::ROWS rows of the
// expert's matrix (blockIdx.x, so that the blocks run one after another share the slots' rows in
// L2). Its 8 warps each own 16 slots by a half of those rows. Every block reads its slots' input
// rows whole, so the more weight rows a block takes and the narrower the rows, the fewer bytes a
// step's inputs move through L2 (the most of a grouped product's traffic): quantized weights take
// 128 rows, 16-bit ones 64 (their staged loads would spill at 128), and the input rows come in the
// 16 bits the MMAs take, f16 (bf16 for bf16 weights), written so by gather_pairs or by the gate and
// up product's epilogue. They and the weights (dequantized by dequant.cuh's chunks, or 16-bit floats
// as stored) go through shared memory EG_DEPTH inputs at a time; the next tile's loads are issued
// before the MMAs of this one. m16n8k16 MMAs, f32 accumulation, fragments by ldmatrix. With GLU the
// block's rows are Tile::ROWS / 2 rows of gate and the same rows of up, interleaved by eights, so
// that a lane holds a gate sum and its up sum and writes act(gate) * up. Rows out are one per slot,
// f32 or (out_type) 16-bit for a down product on these kernels. The tiles take more shared memory
// than a block has statically: the launch asks for (EG_SLOTS + Tile::ROWS) * EG_STRIDE 16-bit values.
#define EG_SLOTS 64
#define EG_DEPTH 128
// Rows of the tiles in shared memory, padded by 16 bytes so that ldmatrix's eight rows fall in
// distinct banks.
#define EG_STRIDE (EG_DEPTH + 8)

// Weights of a quantized type, CHUNKS chunks (32 values) a thread per depth tile: ROWS rows of
// EG_DEPTH / 32 chunks each, chunk i of a thread in row threadIdx.x / 4 + 64 i. Every type's
// chunks 4j..4j+3 hold exactly the row's values 128j..128j+127 (dequant.cuh), so a tile decodes
// whole chunks into place.
template <int TY> struct QuantTile {
    static constexpr bool BF16 = false;
    static constexpr int ROWS = 128, CHUNKS = ROWS * (EG_DEPTH / 32) / 256;
    IntChunk k[CHUNKS];

    __device__ __forceinline__ void load(int i, const Weight& w, int row, bool valid, int tile) {
        int c = tile * (EG_DEPTH / 32) + threadIdx.x % (EG_DEPTH / 32);
        if (valid && 32 * c < w.n_in) {
            k[i] = int_chunk<TY>(w, row, c);
        } else {
            // Zeros, at positions that the tile's other chunks leave to this one.
            k[i] = IntChunk{{}, {0.0f, 0.0f}, {0.0f, 0.0f}, {32 * c, 32 * c + 16}};
        }
    }

    __device__ __forceinline__ void store(int i, u16* tile_row, int tile) const {
        const IntChunk& k = this->k[i];
        for (int r = 0; r < 2; r++) {
            u32 packed[8];
            for (int j = 0; j < 8; j++) {
                u32 word = k.q[4 * r + j / 2] >> (16 * (j % 2));
                float lo = k.scale[r] * (float)(i8)(word & 0xff) + k.offset[r];
                float hi = k.scale[r] * (float)(i8)(word >> 8 & 0xff) + k.offset[r];
                packed[j] = pack_f16(lo, hi);
            }
            uint4* at = (uint4*)(tile_row + k.at[r] - tile * EG_DEPTH);
            at[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            at[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        }
    }
};
static_assert(QuantTile<TY_Q4_K>::CHUNKS * 256 == QuantTile<TY_Q4_K>::ROWS * (EG_DEPTH / 32), "whole chunks a thread");

// Weights stored as 16-bit floats: copied as they are, 8 values at a time, 4 pieces a thread.
template <int TY> struct FloatTile {
    static constexpr bool BF16 = TY == TY_BF16;
    static constexpr int ROWS = 64, PIECES = EG_DEPTH / 8, PER_THREAD = ROWS * PIECES / 256;
    uint4 v[PER_THREAD];
};

// The weight row of the block that tile row r holds: its output row, and whether it is up's.
template <bool GLU> __device__ __forceinline__ int tile_output(int r, bool* up) {
    *up = GLU && (r / 8) % 2;
    return GLU ? 16 * (r / 32) + 8 * ((r % 32) / 16) + r % 8 : r;
}

// Finds the block's tile of slots: the expert and its first slot, or -1 past the last tile. Warp 0 scans
// the experts' tile counts 32 at a time.
__device__ __forceinline__ void find_tile(const u32* offsets, int n_experts, u32 tile, int* expert, u32* first) {
    int lane = threadIdx.x % 32;
    if (lane == 0) *expert = -1;
    __syncwarp();
    u32 before = 0;
    for (int base = 0; base < n_experts; base += 32) {
        int e = base + lane;
        u32 start = 0, tiles = 0;
        if (e < n_experts) {
            start = offsets[e];
            tiles = (offsets[e + 1] - start + EG_SLOTS - 1) / EG_SLOTS;
        }
        u32 through = tiles;  // tiles of experts base..e
        for (int o = 1; o < 32; o <<= 1) {
            u32 v = __shfl_up_sync(0xffffffffu, through, o);
            if (lane >= o) through += v;
        }
        u32 from = before + through - tiles;
        bool mine = tile >= from && tile < from + tiles;
        if (mine) *expert = e, *first = start + (tile - from) * EG_SLOTS;
        if (__ballot_sync(0xffffffffu, mine)) break;
        before += __shfl_sync(0xffffffffu, through, 31);
    }
}

template <typename Tile, int TY, bool GLU> __device__ void expert_gemm(const ExpertProductParams& p) {
    constexpr bool BF16 = Tile::BF16;
    extern __shared__ __align__(16) u16 eg_tiles[];
    u16 *xs = eg_tiles, *ws = eg_tiles + EG_SLOTS * EG_STRIDE;
    __shared__ int tile_expert;
    __shared__ u32 tile_first;
    begin_after_inputs();
    if (threadIdx.x < 32) find_tile(p.offsets, p.n_experts, blockIdx.y, &tile_expert, &tile_first);
    __syncthreads();
    int e = tile_expert;
    if (e < 0) return;
    u32 first = tile_first;
    int n_slots = min((u32)EG_SLOTS, p.offsets[e + 1] - first), n_in = p.n_in;
    constexpr int ROWS = Tile::ROWS, WARP_ROWS = ROWS / 2;
    int out_first = blockIdx.x * (GLU ? ROWS / 2 : ROWS);
    Weight gate = expert_weight(p.w, e, n_in), up = GLU ? expert_weight(p.up, e, n_in) : gate;

    // Input rows, 16-bit already (gather_pairs, or the GLU's epilogue below): EG_SLOTS rows of
    // EG_DEPTH / 8 pieces of 8 values, 4 a thread.
    constexpr int X_PIECES = EG_DEPTH / 8, X_PER_THREAD = EG_SLOTS * X_PIECES / 256;
    const u16* x = (const u16*)p.x;
    uint4 xr[X_PER_THREAD];
    auto load_x = [&](int tile) {
        for (int i = 0; i < X_PER_THREAD; i++) {
            int at = threadIdx.x + 256 * i, slot = at / X_PIECES, col = tile * EG_DEPTH + 8 * (at % X_PIECES);
            xr[i] = slot < n_slots && col < n_in ? *(const uint4*)(x + (u64)(first + slot) * n_in + col)
                                                 : make_uint4(0, 0, 0, 0);
        }
    };
    auto store_x = [&]() {
        for (int i = 0; i < X_PER_THREAD; i++) {
            int at = threadIdx.x + 256 * i;
            *(uint4*)(xs + (at / X_PIECES) * EG_STRIDE + 8 * (at % X_PIECES)) = xr[i];
        }
    };
    // The weight row behind tile row r (past the matrix where at least n_out), and its matrix.
    auto weight_row = [&](int r, Weight* w) {
        bool is_up;
        int o = out_first + tile_output<GLU>(r, &is_up);
        *w = is_up ? up : gate;
        return o;
    };
    Tile wr;
    auto load_w = [&](int tile) {
        if constexpr (TY == TY_F16 || TY == TY_BF16) {
            for (int i = 0; i < Tile::PER_THREAD; i++) {
                int at = threadIdx.x + 256 * i, r = at / Tile::PIECES, col = tile * EG_DEPTH + 8 * (at % Tile::PIECES);
                Weight w;
                int o = weight_row(r, &w);
                wr.v[i] = o < p.n_out && col < n_in ? *(const uint4*)(w.q + ((u64)o * n_in + col) * 2)
                                                    : make_uint4(0, 0, 0, 0);
            }
        } else {
            for (int i = 0; i < Tile::CHUNKS; i++) {
                Weight w;
                int o = weight_row(threadIdx.x / (EG_DEPTH / 32) + 64 * i, &w);
                wr.load(i, w, o, o < p.n_out, tile);
            }
        }
    };
    auto store_w = [&](int tile) {
        if constexpr (TY == TY_F16 || TY == TY_BF16) {
            for (int i = 0; i < Tile::PER_THREAD; i++) {
                int at = threadIdx.x + 256 * i, r = at / Tile::PIECES;
                *(uint4*)(ws + r * EG_STRIDE + 8 * (at % Tile::PIECES)) = wr.v[i];
            }
        } else {
            for (int i = 0; i < Tile::CHUNKS; i++) wr.store(i, ws + (threadIdx.x / (EG_DEPTH / 32) + 64 * i) * EG_STRIDE, tile);
        }
    };

    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int warp_slot = 16 * (warp % 4), warp_row = WARP_ROWS * (warp / 4);
    // ldmatrix rows: A's x4 gives slots 0-7 and 8-15 at depths 0-7, then both at 8-15; B's gives
    // weight rows 0-7 at depths 0-7 and 8-15, then rows 8-15 at both.
    u32 x_at = shared_address(xs + (warp_slot + lane % 16) * EG_STRIDE + 8 * (lane / 16));
    u32 w_at = shared_address(ws + (warp_row + 8 * (lane / 16) + lane % 8) * EG_STRIDE + 8 * (lane / 8 % 2));
    float acc[WARP_ROWS / 8][4] = {};
    int tiles = (n_in + EG_DEPTH - 1) / EG_DEPTH;
    load_x(0);
    load_w(0);
    for (int tile = 0; tile < tiles; tile++) {
        store_x();
        store_w(tile);
        __syncthreads();
        if (tile + 1 < tiles) {
            load_x(tile + 1);
            load_w(tile + 1);
        }
        for (int d = 0; d < EG_DEPTH; d += 16) {
            u32 a[4];
            load_tiles<false>(a, x_at + 2 * d);
            // A fragment of 16 weight rows at a time, used at once (registers for all the warp's
            // rows would cost the second block a multiprocessor).
#pragma unroll
            for (int h = 0; h < WARP_ROWS / 16; h++) {
                u32 b[4];
                load_tiles<false>(b, w_at + 2 * (16 * h * EG_STRIDE + d));
                mma_16<BF16>(acc[2 * h], a, b[0], b[1]);
                mma_16<BF16>(acc[2 * h + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
    }

    // C's layout: lane 4g + c holds slots g (values 0, 1) and g + 8 (2, 3), rows 2c and 2c + 1 of
    // each eight. With GLU, eights 2i and 2i + 1 are gate's and up's of the same rows.
    int g = lane / 4, c = lane % 4;
    for (int half = 0; half < 2; half++) {
        int slot = warp_slot + g + 8 * half;
        if (slot >= n_slots) continue;
        u64 row = (u64)(first + slot) * p.n_out;
        for (int j = 0; j < WARP_ROWS / 8; j++) {
            if (GLU && j % 2) continue;
            bool is_up;
            for (int v = 0; v < 2; v++) {
                int o = out_first + tile_output<GLU>(warp_row + 8 * j + 2 * c + v, &is_up);
                float y = acc[j][2 * half + v];
                if constexpr (GLU) y = glu_of(y, acc[j + 1][2 * half + v], p.act);
                if (o >= p.n_out) continue;
                if (p.out_type == TY_F32)
                    p.out[row + o] = y;
                else
                    ((u16*)p.out)[row + o] = to_16bit(y, p.out_type);
            }
        }
    }
}

#define EXPERT_GEMM(NAME, TILE, TY)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 2) expert_gemm_##NAME(ExpertProductParams p) {                    \
        expert_gemm<TILE<TY>, TY, false>(p);                                                                          \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 2) expert_gemm_glu_##NAME(ExpertProductParams p) {                \
        expert_gemm<TILE<TY>, TY, true>(p);                                                                           \
    }
EXPERT_GEMM(f16, FloatTile, TY_F16)
EXPERT_GEMM(bf16, FloatTile, TY_BF16)
EXPERT_GEMM(q8_0, QuantTile, TY_Q8_0)
EXPERT_GEMM(q4_0, QuantTile, TY_Q4_0)
EXPERT_GEMM(q4_1, QuantTile, TY_Q4_1)
EXPERT_GEMM(q5_0, QuantTile, TY_Q5_0)
EXPERT_GEMM(q4_k, QuantTile, TY_Q4_K)
EXPERT_GEMM(q6_k, QuantTile, TY_Q6_K)
