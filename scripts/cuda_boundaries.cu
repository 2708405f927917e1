// What kernel boundaries cost in a graph shaped like 8B Q4_K decode, with no model: stand-in
// kernels that stream the same bytes (4.2 GB a token, the products' rows as 16-row blocks of 256
// threads) and small kernels that read and write what the norms, RoPE, attention and the
// quantization do, launched as axiom launches them (programmatic dependent launch, the products
// signalling their dependents first thing and reading four 16-byte words a thread before their
// wait, the small kernels signalling after theirs). On a machine with CUDA:
//
//     nvcc -O3 -gencode=arch=compute_90,code=sm_90 scripts/cuda_boundaries.cu -o /tmp/boundaries
//     /tmp/boundaries [--layout split|fused|products] [--sync pdl|counter|none]
//                     [--shared-kb N] [--accumulate] [--l2-prefetch-mb N] [--small-prefetch-mb N]
//
// --layout: split, the nine launches a layer of axiom's decode; fused, five (the norms and the
//   quantization read by the products after their wait, RoPE inside attention); products, the
//   four products alone.
// --sync: pdl, each kernel waits for the one before (griddepcontrol.wait); counter, for a count
//   of finished blocks instead (each block's end a fence and an atomic); none, no waiting at all
//   (wrong results: the streaming alone).
// --shared-kb: unused dynamic shared memory a product block asks for, to hold fewer a
//   multiprocessor (70: three; 100: two).
// --accumulate: the products add to their output (read, add, store), as wo and down do.
// --l2-prefetch-mb: each product's blocks, when done, prefetch this much of the next product's
//   rows into L2 (cp.async.bulk.prefetch.L2), spread over its blocks.
// --small-prefetch-mb: each small kernel, before its wait, prefetches this much of the next
//   product's rows the same way (while the DRAM would otherwise idle).
//
// It prints the copy roofline (one kernel reading every byte) and a token's time over 20 graph
// replays. Figures: docs/performance.md, seventeenth and eighteenth sessions.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// The engine's own helpers: warp_sum, block_sum, load_stream, begin_after_inputs,
// start_dependents.
#include "../crates/axiom/src/backend/cuda/kernels/common.cuh"

#define CHECK(x)                                                                             \
    do {                                                                                     \
        cudaError_t e = (x);                                                                 \
        if (e != cudaSuccess) {                                                              \
            fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);     \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

enum SyncMode { SYNC_PDL, SYNC_COUNTER, SYNC_NONE };

// How a kernel waits for the one before: `target` finished blocks of `done` for the counter.
struct Sync {
    u32* done;
    u32 target;
    int mode;
};

__device__ __forceinline__ void wait_inputs(Sync s) {
    if (s.mode == SYNC_PDL) begin_after_inputs();
    if (s.mode == SYNC_COUNTER) {
        if (threadIdx.x == 0) {
            u32 seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(s.done) : "memory");
                if ((int)(seen - s.target) < 0) __nanosleep(32);
            } while ((int)(seen - s.target) < 0);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ void signal_done(Sync s) {
    if (s.mode != SYNC_COUNTER) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(s.done, 1u);
    }
}

__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// The next product's rows to prefetch into L2: `bytes` of each of its blocks' slices.
struct Prefetch {
    const char* rows;
    int blocks;
    u32 block_bytes, bytes;
};

// Issues `next`'s prefetches, spread over this kernel's threads.
__device__ __forceinline__ void prefetch_l2(Prefetch next) {
    for (int j = blockIdx.x + threadIdx.x * gridDim.x; j < next.blocks; j += blockDim.x * gridDim.x)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(next.rows + (size_t)j * next.block_bytes),
                     "r"(next.bytes)
                     : "memory");
}

// A product: block b streams words [b * block_words, (b + 1) * block_words), four a thread read
// before the wait; after it, `prologue` activations are read and reduced first (a fused norm or
// quantization), then the rest streamed; a warp's sum is stored, or added with `accumulate`.
__global__ void __launch_bounds__(256) product(const uint4* w, int block_words, const float* x, float* out,
                                               int prologue, int accumulate, Prefetch next, Sync s) {
    start_dependents();
    const uint4* mine = w + (size_t)blockIdx.x * block_words;
    int t = threadIdx.x;
    uint4 first[4];
#pragma unroll
    for (int u = 0; u < 4; u++) first[u] = t + 256 * u < block_words ? load_stream(mine + t + 256 * u) : uint4{};
    wait_inputs(s);
    float a = __ldcg(x + (t + 7 * blockIdx.x) % 4096);
    if (prologue) {
        float sq = 0.0f;
        for (int i = t; i < prologue; i += 256) sq += __ldcg(x + i) * __ldcg(x + i);
        a += 1e-6f * block_sum(sq);
    }
    u32 acc = 0;
#pragma unroll
    for (int u = 0; u < 4; u++) acc += fold(first[u]);
    int i = t + 1024;
    for (; i + 768 < block_words; i += 1024) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = load_stream(mine + i + 256 * u);
#pragma unroll
        for (int u = 0; u < 4; u++) acc += fold(v[u]);
    }
    for (; i < block_words; i += 256) acc += fold(load_stream(mine + i));
    float sum = warp_sum(1e-9f * (float)(acc & 0xffff) * a);
    if (t % 32 == 0) {
        float* o = out + blockIdx.x * 8 + t / 32;
        *o = accumulate ? *o + sum : sum;
    }
    if (next.bytes) prefetch_l2(next);
    signal_done(s);
}

// A small kernel: reads n_in values of the last output `rounds` times over, writes n_out.
__global__ void __launch_bounds__(256) small_kernel(const float* in, int n_in, float* out, int n_out, int rounds,
                                                    Prefetch next, Sync s) {
    if (next.bytes) prefetch_l2(next);
    wait_inputs(s);
    start_dependents();
    float v = 0.0f;
    for (int r = 0; r < rounds; r++)
        for (int i = threadIdx.x; i < n_in; i += 256) v += __ldcg(in + (i + 97 * r + blockIdx.x) % n_in);
    float total = block_sum(v);
    int o = blockIdx.x * 256 + threadIdx.x;
    if (o < n_out) out[o] = 1e-3f * total + 1.0f;
    signal_done(s);
}

__global__ void read_all(const uint4* w, size_t n, float* out) {
    u32 acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc += fold(load_stream(w + i));
    if (acc == 0x12345u) out[0] = 1.0f;  // never: keeps the loads
}

struct Launch {
    bool is_product;
    int blocks;
    int block_words;  // products
    size_t offset;    // products: where its rows start
    int prologue;     // products
    int n_in, n_out, rounds;  // small kernels
};

int main(int argc, char** argv) {
    std::string layout = "split", sync = "pdl";
    int shared_kb = 0, accumulate = 0;
    double prefetch_mb = 0.0, small_prefetch_mb = 0.0;
    for (int a = 1; a < argc; a++) {
        std::string arg = argv[a];
        bool has_value = a + 1 < argc;
        if (arg == "--layout" && has_value) layout = argv[++a];
        else if (arg == "--sync" && has_value) sync = argv[++a];
        else if (arg == "--shared-kb" && has_value) shared_kb = atoi(argv[++a]);
        else if (arg == "--l2-prefetch-mb" && has_value) prefetch_mb = atof(argv[++a]);
        else if (arg == "--small-prefetch-mb" && has_value) small_prefetch_mb = atof(argv[++a]);
        else if (arg == "--accumulate") accumulate = 1;
        else {
            fprintf(stderr, "unknown argument %s (see the comment at the top)\n", arg.c_str());
            return 2;
        }
    }
    int mode = sync == "pdl" ? SYNC_PDL : sync == "counter" ? SYNC_COUNTER : sync == "none" ? SYNC_NONE : -1;
    if (mode < 0 || (layout != "split" && layout != "fused" && layout != "products")) {
        fprintf(stderr, "--layout split|fused|products, --sync pdl|counter|none\n");
        return 2;
    }

    // Q4_K bytes of a row of 4096 and of 14336 values; 16 rows a product block.
    const size_t row = 2304, long_row = 8064;
    std::vector<Launch> seq;
    size_t bytes = 0;
    auto product_of = [&](int rows, size_t row_bytes, int prologue) {
        seq.push_back(Launch{true, rows / 16, (int)(row_bytes), bytes, prologue, 0, 0, 0});
        bytes += rows * row_bytes;
    };
    auto small = [&](int blocks, int n_in, int n_out, int rounds) {
        seq.push_back(Launch{false, blocks, 0, 0, 0, n_in, n_out, rounds});
    };
    bool fused = layout == "fused";
    for (int layer = 0; layer < 32; layer++) {
        if (layout == "split") small(16, 4096, 4096, 1);  // rms_norm_q8
        product_of(6144, row, fused ? 4096 : 0);          // QKV
        if (layout == "split") small(8, 6144, 2048, 1);   // rope_kv_write
        if (layout != "products") small(32, 4096, 4096, 4);  // attention
        product_of(4096, row, 0);                         // wo
        if (layout == "split") small(16, 4096, 4096, 1);  // rms_norm_q8
        product_of(28672, row, fused ? 4096 : 0);         // gate and up
        if (layout == "split") small(14, 14336, 14336, 1);  // quantize_q8
        product_of(4096, long_row, fused ? 14336 : 0);    // down
    }
    product_of(128256, row, 0);  // LM head
    small(1, 128256 / 8, 1, 1);  // argmax

    uint4* w;
    float *x_a, *x_b;
    u32* done;
    const size_t act_bytes = 64 << 20;
    CHECK(cudaMalloc(&w, bytes));
    CHECK(cudaMemset(w, 1, bytes));
    CHECK(cudaMalloc(&x_a, act_bytes));
    CHECK(cudaMalloc(&x_b, act_bytes));
    CHECK(cudaMemset(x_a, 0, act_bytes));
    CHECK(cudaMemset(x_b, 0, act_bytes));
    CHECK(cudaMalloc(&done, 4));
    CHECK(cudaFuncSetAttribute(product, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    float ms;
    printf("%.3f GB a token in %zu launches; layout %s, sync %s, shared %d KB%s, L2 prefetch %.0f MB, by small kernels %.0f MB\n",
           bytes / 1e9, seq.size(), layout.c_str(), sync.c_str(), shared_kb, accumulate ? ", accumulating" : "",
           prefetch_mb, small_prefetch_mb);
    for (int k = 0; k < 3; k++) {  // the first warms up
        CHECK(cudaEventRecord(start, stream));
        read_all<<<132 * 8, 512, 0, stream>>>(w, bytes / 16, x_a);
        CHECK(cudaEventRecord(end, stream));
        CHECK(cudaEventSynchronize(end));
        CHECK(cudaEventElapsedTime(&ms, start, end));
        if (k) printf("one read of every byte: %.1f us, %.2f TB/s\n", 1e3 * ms, bytes / (1e-3 * ms) / 1e12);
    }

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    CHECK(cudaMemsetAsync(done, 0, 4, stream));
    u32 finished = 0;  // blocks launched before this one
    for (size_t k = 0; k < seq.size(); k++) {
        const Launch& l = seq[k];
        float* in = k % 2 ? x_a : x_b;
        float* out = k % 2 ? x_b : x_a;
        Sync s{done, finished, mode};
        cudaLaunchAttribute overlap;
        overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        overlap.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(l.blocks);
        config.blockDim = dim3(256);
        config.stream = stream;
        config.attrs = &overlap;
        config.numAttrs = 1;
        // The next product's first `mb` MB, as a share of each of its blocks' slices.
        auto next_product = [&](double mb) {
            for (size_t j = k + 1; j < seq.size() && mb > 0; j++)
                if (seq[j].is_product) {
                    u32 block_bytes = 16 * seq[j].block_words;
                    double share = mb * 1e6 / ((double)block_bytes * seq[j].blocks);
                    u32 each = (u32)(share >= 1.0 ? block_bytes : share * block_bytes) / 16 * 16;
                    return Prefetch{(const char*)w + seq[j].offset, seq[j].blocks, block_bytes, each};
                }
            return Prefetch{nullptr, 0, 0, 0};
        };
        if (l.is_product) {
            config.dynamicSmemBytes = shared_kb * 1024;
            CHECK(cudaLaunchKernelEx(&config, product, (const uint4*)((const char*)w + l.offset), l.block_words,
                                     (const float*)in, out, l.prologue, accumulate, next_product(prefetch_mb), s));
        } else {
            CHECK(cudaLaunchKernelEx(&config, small_kernel, (const float*)in, l.n_in, out, l.n_out, l.rounds,
                                     next_product(small_prefetch_mb), s));
        }
        finished += l.blocks;
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int k = 0; k < 3; k++) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    const int replays = 20;
    CHECK(cudaEventRecord(start, stream));
    for (int k = 0; k < replays; k++) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    CHECK(cudaEventElapsedTime(&ms, start, end));
    double us = 1e3 * ms / replays;
    printf("a token: %.1f us (%.1f tok/s), %.2f TB/s\n", us, 1e6 / us, bytes / (1e-6 * us) / 1e12);
    return 0;
}
