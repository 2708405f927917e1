// Runs a compute kernel on the CPU the way a GPU would schedule it, slowly but faithfully enough
// to test it: the threadgroups one after another, each GPU thread of a group a fiber on one OS
// thread that runs until it reaches a barrier, in thread order. threadgroup_barrier waits for the
// group's threads; simdgroup_barrier, simd_* functions and simdgroup matrix multiplies wait for
// (and exchange values among) the 32 lanes of a simdgroup. A thread that returns leaves both
// barriers, as an inactive lane would. Fibers switch without the kernel's help, so a missing barrier
// shows as a thread reading what a later thread has not yet written (or has already overwritten).
// Under ThreadSanitizer (MSL_CPU_OS_THREADS) every GPU thread is an OS thread instead, so that it
// sees the races.
//
// What this cannot catch: Metal-only language rules (the real compiler is only on macOS),
// fast-math differences, races between threadgroups (they never overlap here), and barriers
// whose absence happens not to change what the threads read.
#pragma once

#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#ifndef MSL_CPU_OS_THREADS
#include <ucontext.h>
#endif

namespace msl_cpu {
// Named before metal_stdlib makes `thread` an address-space keyword (an empty macro).
using OsThread = std::thread;
}  // namespace msl_cpu

#include "metal_stdlib"

namespace msl_cpu {

constexpr uint SIMD_WIDTH = 32;

#ifdef MSL_CPU_OS_THREADS
using Barrier = std::barrier<>;
#else
inline void yield();

// A barrier among fibers: waiting hands the OS thread to the next fiber until the last one arrives.
class Barrier {
  public:
    explicit Barrier(uint n) : expected(n) {}
    void arrive_and_wait() {
        uint generation_now = generation;
        if (++arrived == expected) {
            release();
            return;
        }
        while (generation == generation_now) yield();
    }
    void arrive_and_drop() {
        expected--;
        if (expected > 0 && arrived == expected) release();
    }

  private:
    void release() {
        arrived = 0;
        generation++;
    }
    uint expected;
    uint arrived = 0;
    uint generation = 0;
};
#endif

struct Simdgroup {
    explicit Simdgroup(uint n) : size(n), sync(n) {}
    uint size;
    Barrier sync;
    uint64_t slots[SIMD_WIDTH] = {};
    // The two operands of a simdgroup matrix multiply, every lane's elements.
    float matrices[2][64] = {};
    bool active[SIMD_WIDTH] = {};
};

struct Group {
    explicit Group(uint n) : sync(n) {}
    Barrier sync;
    std::vector<std::unique_ptr<Simdgroup>> simds;
};

// What a GPU thread knows about itself: the [[attribute]] parameters of a kernel.
struct Thread {
    uint3 group;        // threadgroup_position_in_grid
    uint3 local;        // thread_position_in_threadgroup
    uint3 grid;         // thread_position_in_grid
    uint index;         // thread_index_in_threadgroup
    uint threads;       // threads_per_threadgroup (their product)
    uint simd;          // simdgroup_index_in_threadgroup
    uint simds;         // simdgroups_per_threadgroup
    uint lane;          // thread_index_in_simdgroup
    uint lanes;         // threads_per_simdgroup
    Group* group_state;
    Simdgroup* simd_state;
};

inline thread_local Thread* current = nullptr;

// Every lane stores its value, then reads all active lanes' values once everyone has stored.
template <typename T, typename Op>
T simd_reduce(T v, Op op) {
    Simdgroup& s = *current->simd_state;
    std::memcpy(&s.slots[current->lane], &v, sizeof(T));
    s.sync.arrive_and_wait();
    bool first = true;
    T result = v;
    for (uint i = 0; i < s.size; i++) {
        if (!s.active[i]) continue;
        T other;
        std::memcpy(&other, &s.slots[i], sizeof(T));
        result = first ? other : op(result, other);
        first = false;
    }
    s.sync.arrive_and_wait();  // nobody stores the next value before all have read this one
    return result;
}

#ifndef MSL_CPU_OS_THREADS
// The fibers of the threadgroup running now, on this OS thread.
struct Fibers {
    // Big enough for any kernel's locals; only the pages a fiber touches are ever committed.
    static constexpr size_t STACK_BYTES = 256 * 1024;
    ucontext_t scheduler;
    std::vector<ucontext_t> contexts;
    char* stacks;
    std::vector<Thread>* threads;
    void (*run)(void* body, Thread& t);
    void* body;
    uint running = 0;
};
inline thread_local Fibers* fibers = nullptr;

inline void yield() { swapcontext(&fibers->contexts[fibers->running], &fibers->scheduler); }

inline void fiber_main() {
    Fibers& f = *fibers;
    Thread& t = (*f.threads)[f.running];
    f.run(f.body, t);
    t.simd_state->active[t.lane] = false;
    t.simd_state->sync.arrive_and_drop();
    t.group_state->sync.arrive_and_drop();
}  // returns to the scheduler through uc_link

// Runs a threadgroup's `threads` as fibers, round robin, each to its next barrier or its end.
// The scheduler's context is saved at each switch and resumed right there, nothing changed in
// between, so GCC's setjmp-style warning about clobbered locals does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
inline void run_fibers(Fibers& f, std::vector<Thread>& threads) {
    uint n = threads.size();
    f.threads = &threads;
    for (uint i = 0; i < n; i++) {
        ucontext_t& c = f.contexts[i];
        getcontext(&c);
        c.uc_stack.ss_sp = f.stacks + i * Fibers::STACK_BYTES;
        c.uc_stack.ss_size = Fibers::STACK_BYTES;
        c.uc_link = &f.scheduler;
        makecontext(&c, fiber_main, 0);
    }
    std::vector<bool> done(n, false);
    for (uint left = n; left > 0;) {
        for (uint i = 0; i < n; i++) {
            if (done[i]) continue;
            f.running = i;
            current = &threads[i];
            swapcontext(&f.scheduler, &f.contexts[i]);
            // A fiber that ended came back through uc_link, its lane marked inactive.
            if (!threads[i].simd_state->active[threads[i].lane]) {
                done[i] = true;
                left--;
            }
        }
    }
    current = nullptr;
}
#pragma GCC diagnostic pop
#endif

// Runs `body(thread)` for every thread of `groups` threadgroups of `per_group` threads.
// Kernels keep threadgroup memory in statics, so launches are serialised.
template <typename Body>
void launch(uint3 groups, uint3 per_group, Body body) {
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    uint n = per_group.x * per_group.y * per_group.z;
    uint n_simds = (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
#ifndef MSL_CPU_OS_THREADS
    // Kept from launch to launch: mapping and faulting in fresh stacks each time costs more than
    // the kernels.
    static std::unique_ptr<char[]> stacks;
    static size_t stacks_for = 0;
    if (stacks_for < n) {
        stacks = std::make_unique_for_overwrite<char[]>(n * Fibers::STACK_BYTES);
        stacks_for = n;
    }
    Fibers f;
    f.contexts.resize(n);
    f.stacks = stacks.get();
    f.run = [](void* b, Thread& t) { (*static_cast<Body*>(b))(t); };
    f.body = &body;
    fibers = &f;
#endif
    for (uint gz = 0; gz < groups.z; gz++)
        for (uint gy = 0; gy < groups.y; gy++)
            for (uint gx = 0; gx < groups.x; gx++) {
                Group group(n);
                for (uint s = 0; s < n_simds; s++) {
                    group.simds.push_back(std::make_unique<Simdgroup>(std::min(SIMD_WIDTH, n - s * SIMD_WIDTH)));
                    for (uint l = 0; l < group.simds.back()->size; l++) group.simds.back()->active[l] = true;
                }
                std::vector<Thread> threads;
                for (uint i = 0; i < n; i++) {
                    uint3 local = {i % per_group.x, i / per_group.x % per_group.y, i / (per_group.x * per_group.y)};
                    threads.push_back({
                        {gx, gy, gz},
                        local,
                        {gx * per_group.x + local.x, gy * per_group.y + local.y, gz * per_group.z + local.z},
                        i,
                        n,
                        i / SIMD_WIDTH,
                        n_simds,
                        i % SIMD_WIDTH,
                        SIMD_WIDTH,
                        &group,
                        group.simds[i / SIMD_WIDTH].get(),
                    });
                }
#ifdef MSL_CPU_OS_THREADS
                std::vector<OsThread> workers;
                for (uint i = 0; i < n; i++) {
                    workers.emplace_back([&, i] {
                        Thread& t = threads[i];
                        current = &t;
                        body(t);
                        t.simd_state->active[t.lane] = false;
                        t.simd_state->sync.arrive_and_drop();
                        group.sync.arrive_and_drop();
                        current = nullptr;
                    });
                }
                for (auto& w : workers) w.join();
#else
                run_fibers(f, threads);
#endif
            }
#ifndef MSL_CPU_OS_THREADS
    fibers = nullptr;
#endif
}

}  // namespace msl_cpu

namespace metal {
inline void threadgroup_barrier(mem_flags) { msl_cpu::current->group_state->sync.arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { msl_cpu::current->simd_state->sync.arrive_and_wait(); }
inline float simd_sum(float v) {
    return msl_cpu::simd_reduce(v, [](float a, float b) { return a + b; });
}
inline float simd_max(float v) {
    return msl_cpu::simd_reduce(v, [](float a, float b) { return a > b ? a : b; });
}
inline uint simd_min(uint v) {
    return msl_cpu::simd_reduce(v, [](uint a, uint b) { return a < b ? a : b; });
}

// Loads and stores touch only the lane's own two elements, as on the GPU.
template <typename T>
void simdgroup_load(simdgroup_matrix<T, 8>& d, const T* src, ulong elements_per_row) {
    for (uint k = 0; k < 2; k++) {
        uint e = 2 * msl_cpu::current->lane + k;
        d.lane[k] = src[e / 8 * elements_per_row + e % 8];
    }
}

template <typename T>
void simdgroup_store(simdgroup_matrix<T, 8> a, T* dst, ulong elements_per_row) {
    for (uint k = 0; k < 2; k++) {
        uint e = 2 * msl_cpu::current->lane + k;
        dst[e / 8 * elements_per_row + e % 8] = a.lane[k];
    }
}

// d = a * b + c. Every lane publishes its elements of a and b, then computes its own of d from
// all of them; the whole simdgroup must take part, so a missing lane stops the run.
template <typename T>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8>& d, simdgroup_matrix<T, 8> a, simdgroup_matrix<T, 8> b,
                                   simdgroup_matrix<T, 8> c) {
    msl_cpu::Simdgroup& s = *msl_cpu::current->simd_state;
    uint lane = msl_cpu::current->lane;
    bool whole = s.size == msl_cpu::SIMD_WIDTH;
    for (uint i = 0; i < s.size; i++) whole = whole && s.active[i];
    if (!whole) {
        std::fprintf(stderr, "simdgroup_multiply_accumulate without all 32 lanes of the simdgroup\n");
        std::abort();
    }
    for (uint k = 0; k < 2; k++) {
        s.matrices[0][2 * lane + k] = float(a.lane[k]);
        s.matrices[1][2 * lane + k] = float(b.lane[k]);
    }
    s.sync.arrive_and_wait();
    for (uint k = 0; k < 2; k++) {
        uint row = (2 * lane + k) / 8, col = (2 * lane + k) % 8;
        float sum = float(c.lane[k]);
        for (uint m = 0; m < 8; m++) sum += s.matrices[0][row * 8 + m] * s.matrices[1][m * 8 + col];
        d.lane[k] = T(sum);
    }
    s.sync.arrive_and_wait();  // nobody publishes the next operands before all have read these
}
}  // namespace metal
