// RoPE on Q and K and the KV-cache write in one launch, for the start of a layer's attention.
// Grid: (tokens, groups of `group` heads from `first_head`, query heads then key heads). A block
// computes its token's angles once, into shared memory (a sincos in double precision is costly,
// and every head of a token turns by the same angles), then rotates its heads in place, key heads
// also into the token's cache row (page_row in common.cuh), and copies their value heads there.
// With `turns_out` (flash attention's steps: first_head is the first key head), the block
// instead leaves its token's angles there for flash attention to rotate the queries with as it
// loads them, and the keys go to the cache only: the queries are not read or written here.
#define ROPE_MAX_PAIRS 128
template <typename T>
__device__ void rope_kv_write(float* q, float* k, const float* v, T* k_cache, T* v_cache, const u32* positions,
                              const float* freqs, const u32* tables, int table_width, const u32* token_seqs,
                              int page_size, int n_heads, int n_kv_heads, int head_dim, int dims, int halves,
                              float scale, int first_head, int group, float2* turns_out) {
    __shared__ double2 turns[ROPE_MAX_PAIRS];
    int t = blockIdx.x, half = dims / 2;
    int h0 = first_head + blockIdx.y * group, h1 = min(h0 + group, n_heads + n_kv_heads);
    u32 pos = positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) turns[i] = turn(pos, freqs, i, scale);
    // The token's cache row, where this block has key heads.
    u64 row = h1 > n_heads ? page_row(tables + (u64)token_seqs[t] * table_width, page_size, pos) : 0;
    // The angles and the cache row come from the positions and block tables, which the host
    // copies in before the step's kernels (common.cuh), so they are found before the wait,
    // overlapping the products before this kernel, which let it start early.
    begin_after_inputs();
    u64 kv_row = row * n_kv_heads * head_dim, kv_src = (u64)t * n_kv_heads * head_dim;
    if (turns_out && blockIdx.y == 0)
        for (int i = threadIdx.x; i < half; i += blockDim.x)
            turns_out[(u64)t * half + i] = make_float2((float)turns[i].x, (float)turns[i].y);
    __syncthreads();
    for (int p = threadIdx.x; p < (h1 - h0) * half; p += blockDim.x) {
        int h = h0 + p / half, i = p % half;
        int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        bool key = h >= n_heads;
        float* head = key ? k + kv_src + (u64)(h - n_heads) * head_dim : q + ((u64)t * n_heads + h) * head_dim;
        float2 x = rotated(head[a], head[b], turns[i]);
        if (!turns_out) {
            head[a] = x.x;
            head[b] = x.y;
        }
        if (key) {
            T* cached = k_cache + kv_row + (u64)(h - n_heads) * head_dim;
            put(cached + a, x.x);
            put(cached + b, x.y);
        }
    }
    // The key heads' dimensions past the rotated ones, and the value heads, as they are.
    int first = (max(h0, n_heads) - n_heads) * head_dim, last = (h1 - n_heads) * head_dim;
    for (int j = first + threadIdx.x; j < last; j += blockDim.x) {
        if (j % head_dim >= dims) put(k_cache + kv_row + j, k[kv_src + j]);
        put(v_cache + kv_row + j, v[kv_src + j]);
    }
}

#define ROPE_KV_WRITE(NAME, T)                                                                                     \
    extern "C" __global__ void rope_kv_write_##NAME(RopeKvWriteParams p) {                                       \
        rope_kv_write(p.q, p.k, p.v, (T*)p.k_cache, (T*)p.v_cache, p.positions, p.freqs, p.tables, p.table_width,  \
                      p.token_seqs, p.page_size, p.n_heads, p.n_kv_heads, p.head_dim, p.dims, p.halves, p.scale,   \
                      p.first_head, p.group, p.turns_out);                                                         \
    }
ROPE_KV_WRITE(f16, u16)
ROPE_KV_WRITE(f32, float)
