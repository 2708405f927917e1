// Shared by every kernel: fixed-width types and conversions written without CUDA headers, so
// NVRTC compiles these sources anywhere (the CI machine has NVRTC but no CUDA toolkit).
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
    return (u16)(bits >> 16);
}

__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

// The sum of v over the warp (float or int), returned to every lane.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (whole warps, up to 1024 threads), returned to every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    // Each warp adds the partials by shuffles (the same sum in every lane and warp): a loop over
    // them takes several times the instructions in each of a norm's warps.
    int lane = threadIdx.x % 32;
    return warp_sum(lane < blockDim.x / 32 ? partial[lane] : 0.0f);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Interleaved rows. The Q4_K and Q6_K integer kernel (kquant_rows in matmul.cu) gives each lane a
// group of quants, 64 values (32 bytes; Q6_K's 48), and the 64 int8 activations they multiply:
// stored in order, a warp's 16-byte loads would lie 32 to 64 bytes apart, and L1 would be the
// limit. So their quants are repacked at load (`interleave_row` in cuda/weights.rs) and the
// activations they take are written in the same order: a row's units (a group of quants, or 64 activations) in tiles of INTERLEAVE_UNITS, each
// tile stored 16-byte piece by piece: piece k of unit u at k * width + u of its tile, width the
// tile's units (a row's last tile may be narrower). Eight lanes' loads of one piece are then 128
// contiguous bytes.
#define INTERLEAVE_UNITS 8
__device__ __forceinline__ int tile_width(int unit, int n_units) {
    return min(INTERLEAVE_UNITS, n_units - (unit & ~(INTERLEAVE_UNITS - 1)));
}
// The 16-byte piece where unit `unit`'s first piece lies, for units of `pieces` pieces; its piece k
// follows k * tile_width pieces later.
__device__ __forceinline__ int unit_start(int unit, int pieces) {
    int first = unit & ~(INTERLEAVE_UNITS - 1);
    return first * pieces + unit - first;
}

// A value as a type: a generic lambda called with Constant<v>{} is compiled apart for each v,
// which it reads back as decltype(arg)::value.
template <auto V> struct Constant { static constexpr auto value = V; };

// Activations quantized for the integer matrix-vector kernels (matmul.cu): value i of an aligned
// block of 32, held one per lane of a warp, becomes round(v / d) with d = max |v| / 127 over the
// block (taken as v times 127 / max |v|, as the CPU's fast path takes v times 1 / d: one division
// a block, beside d's, where one a value lay on the norms' and the quantization's critical path),
// d stored once per block. The values lie in xq in order, or interleaved for Q4_K and Q6_K in
// units of 64 (`q8_slot`); their scales always in order, in xd. For those (`sums`), each block's
// scale is followed by the sum of its quantized values (an int in the next float's bits), which
// Q4_K's minimums and Q6_K's offset of 32 multiply: summed once here rather than by every warp
// for every row.
__device__ __forceinline__ float quant_factor(float amax) { return amax == 0.0f ? 0.0f : 127.0f / amax; }
__device__ __forceinline__ i8 quantize_by(float v, float factor) { return (i8)__float2int_rn(v * factor); }

// Where value v of a row of n activations lies in xq (n a multiple of 256 when interleaved).
__device__ __forceinline__ int q8_slot(int v, int n, bool interleave) {
    if (!interleave) return v;
    int unit = v / 64;
    return 16 * (unit_start(unit, 4) + v % 64 / 16 * tile_width(unit, n / 64)) + v % 16;
}

// Block b's scale into xd (with `sums`, its sum after it).
__device__ __forceinline__ void store_q8_scale(float* xd, u64 b, float d, int sum, bool sums) {
    xd[sums ? 2 * b : b] = d;
    if (sums) xd[2 * b + 1] = __int_as_float(sum);
}

// Value i (of all rows) into xq at `slot` (q8_slot of its row, plus the row's start).
__device__ __forceinline__ void store_q8(float v, i8* xq, float* xd, u64 i, u64 slot, bool sums) {
    float amax = warp_max(fabsf(v)), d = amax / 127.0f;
    i8 q = quantize_by(v, quant_factor(amax));
    xq[slot] = q;
    int sum = sums ? warp_sum((int)q) : 0;
    if (i % 32 == 0) store_q8_scale(xd, i / 32, d, sum, sums);
}

// store_q8 for four neighbouring values held by one thread, values 4 * i4 to 4 * i4 + 3, stored in
// word slot4 of xq: eight neighbouring lanes hold a block of 32 (i4 % 8 is the lane's place in it),
// and one 4-byte store writes a thread's quants. Every lane of the warp takes part (the shuffles);
// those with `valid` store.
__device__ __forceinline__ void store_q8x4(float4 v, bool valid, u32* xq, float* xd, u64 i4, u64 slot4, bool sums) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.0f, factor = quant_factor(amax);
    i8 q[4] = {quantize_by(v.x, factor), quantize_by(v.y, factor), quantize_by(v.z, factor), quantize_by(v.w, factor)};
    int sum = 0;
    if (sums) {
        sum = q[0] + q[1] + q[2] + q[3];
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (valid) {
        xq[slot4] = (u32)(u8)q[0] | (u32)(u8)q[1] << 8 | (u32)(u8)q[2] << 16 | (u32)(u8)q[3] << 24;
        if (i4 % 8 == 0) store_q8_scale(xd, i4 / 8, d, sum, sums);
    }
}

// GGUF type ids, as in format/quant.rs.
#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q4_1 3
#define TY_Q5_0 6
#define TY_Q8_0 8
#define TY_Q4_K 12
#define TY_Q6_K 14
#define TY_BF16 30
// FP8 checkpoints' E4M3 weights have no GGUF id (GgmlType::Fp8): a number of their own.
#define TY_FP8 1000

// f32 to f16 (kind TY_F16) or bf16 (TY_BF16), the 16-bit inputs of cuBLAS.
__device__ __forceinline__ u16 to_16bit(float v, int kind) { return kind == TY_BF16 ? f32_to_bf16(v) : f32_to_f16(v); }
__device__ __forceinline__ float from_16bit(u16 v, int kind) { return kind == TY_BF16 ? bf16_to_f32(v) : f16_to_f32(v); }
// Four values in 16 bits, as to_16bit makes each.
__device__ __forceinline__ uint2 pack_16bit4(float4 v, int kind) {
    return make_uint2((u32)to_16bit(v.x, kind) | ((u32)to_16bit(v.y, kind) << 16),
                      (u32)to_16bit(v.z, kind) | ((u32)to_16bit(v.w, kind) << 16));
}

// The paged KV cache: a sequence's position p lives in row table[p / page_size] * page_size +
// p % page_size of each layer's cache, where table is its row of the block tables. The page size
// is a power of two (the host checks), so these are a shift and a mask: a division by a run-time
// value is a long run of instructions, and attention finds a row per key. READ_ONLY: the table
// is read through the read-only cache (__ldg), as attention's `const __restrict__` tables are.
template <bool READ_ONLY = false>
__device__ __forceinline__ u64 page_row(const u32* table, int page_size, u32 p) {
    int shift = __ffs(page_size) - 1;
    u32 page = READ_ONLY ? __ldg(table + (p >> shift)) : table[p >> shift];
    return ((u64)page << shift) | (p & (page_size - 1));
}

// Programmatic dependent launch (Hopper and later; a no-op before). The host launches every kernel
// so that the GPU may prepare it while the one before is finishing, and each kernel waits here for
// the one before to finish and its writes to be visible: before the wait, nothing may be written,
// and nothing read that the step writes (weights may be: ReadsBeforeWait in matmul.cu, the norms'
// weights in rms_norm_q8 and normalize_row; and so may the positions and block tables: the host
// copies them in before the step's kernels, and a kernel never starts before a copy ahead of it
// has finished: rope_kv_write; and with them, in a step of one token, the cache rows before its
// position, which only earlier steps wrote: attention). Kernels signal their dependents early
// only where it pays (start_dependents below): when every kernel did so right after its wait,
// blocks of the next kernel sat on the multiprocessors while this one ran and slowed it.
__device__ __forceinline__ void begin_after_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel's blocks start before this one ends (a no-op before Hopper): they run up to
// their own wait. The kernels that quantize activations call it (the norm or the attention before
// an integer matrix-vector product), right after their wait, so the next kernel takes only
// multiprocessors they leave idle. The product reads its first weights before its wait
// (`int_row`), so that read overlaps the quantization. The host asks for it where it pays
// (`starts_next_early` in cuda/matmul.rs). The one-token products that read before their wait call it
// first thing, for the few blocks of the small kernel after them (ReadsBeforeWait in matmul.cu):
// then three kernels may be in flight, so a kernel's code before its wait may run while the one two
// before it is still running.
__device__ __forceinline__ void start_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
    return a;
}

// A weight load (the float matrix-vector kernels in matmul.cu). Each weight is read once a token,
// so it is not kept in L1 (no_allocate), which leaves L1 to the activations that every warp reads
// again.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 16 bytes from global to shared memory without passing through registers; zeros where !valid.
__device__ __forceinline__ void copy_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// copy_async16 of bytes read once a step (decode's weights) under an evict-first L2 policy: their
// lines are evicted first, so that gigabytes streamed through L2 do not push out what the kernels
// on the critical path read again (the residual, the activations, the norms' weights, the cache
// rows). The policy is made in the same asm as the copy: ptxas then keeps it in the uniform
// registers that the copy's descriptor reads, where a policy made once apart was moved through
// vector registers and back for every copy (two instructions a copy).
__device__ __forceinline__ void copy_async16_read_once(u32 dst, const void* src, bool valid) {
    asm volatile(
        "{ .reg .b64 policy; createpolicy.fractional.L2::evict_first.b64 policy, 1.0;"
        " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, policy; }" ::"r"(dst),
        "l"(src), "r"(valid ? 16 : 0));
}

// d += a b on the tensor cores (mma.m16n8k16, f32 accumulation; the fragment layouts are in
// flash_attention.cu), the inputs f16 or (BF16) bf16.
template <bool BF16 = false>
__device__ __forceinline__ void mma_16(float* d, const u32* a, u32 b0, u32 b1) {
    if (BF16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1) { mma_16<false>(d, a, b0, b1); }

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// Four 8x8 tiles of 16-bit values from shared memory, lane l giving the address of row l % 8 of
// tile l / 8; TRANSPOSE hands each lane its values as if the tiles were transposed.
template <bool TRANSPOSE>
__device__ __forceinline__ void load_tiles(u32* r, u32 address) {
    if (TRANSPOSE)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(address));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(address));
}

// 4 bytes (4-aligned) copied as copy_async16_read_once copies 16: Q6_K's d, a float a super-block.
__device__ __forceinline__ void copy_async4_read_once(u32 dst, const void* src) {
    asm volatile(
        "{ .reg .b64 policy; createpolicy.fractional.L2::evict_first.b64 policy, 1.0;"
        " cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 4, 4, policy; }" ::"r"(dst),
        "l"(src));
}
