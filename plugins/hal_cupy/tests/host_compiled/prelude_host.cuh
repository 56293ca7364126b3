// Host (CPU) prelude for the hal kernel sources: compiles the real .cu files
// with a C++17 compiler (g++) so their numerics can be tested without a GPU.
// It takes the place of prelude_cuda.cuh / prelude_hip.cuh (see
// plugins/hal_cupy/src/hal_cupy/kernels/README.md) and is only used by the tests.
//
// Execution model: one launch runs its CTAs one after another (x fastest, then
// y, z; in a seeded random order after hal_host_shuffle_ctas(1)); the threads of
// a CTA are cooperative fibers (ucontext) on a single OS thread.  A fiber runs
// until it reaches a synchronisation point -- a CTA barrier or a warp shuffle
// -- and waits there until every thread of its CTA (or warp) has arrived, as
// on a GPU.  Between synchronisation points threads are interleaved in an
// order reshuffled every round from a seed, so a missing barrier shows up as
// a wrong result; a barrier that not every thread reaches is reported as a
// deadlock instead of hanging.  __shared__ variables become function-local
// statics, i.e. one copy shared by the threads of the running CTA.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <vector>

#define HAL_PRELUDE 1
#define HAL_HOST 1

#ifndef HAL_WARP_SIZE
#define HAL_WARP_SIZE 32
#endif

#define HAL_DEVICE static inline
#define HAL_GLOBAL static
#define HAL_LAUNCH_BOUNDS(n)
#define HAL_RESTRICT __restrict__
#define __shared__ static

// CUDA vector types and built-in variables (only .x of the thread index is used).
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x, y, z; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static dim3 threadIdx, blockIdx, gridDim, blockDim;

typedef uint4 hal_vec16;
typedef uint2 hal_vec8;

namespace hal_host {

constexpr unsigned kMaxThreads = 1024;
constexpr std::size_t kStackBytes = 256 * 1024;

struct Barrier {
    unsigned expected = 0, arrived = 0;
    unsigned long long generation = 0;
};

struct Runtime {
    ucontext_t scheduler;
    std::vector<ucontext_t> fibers;
    std::vector<std::unique_ptr<char[]>> stacks;
    std::vector<unsigned char> done;
    unsigned current = 0;
    unsigned long long events = 0;  // arrivals and exits: the progress marker
    Barrier cta;
    std::vector<Barrier> warps;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    unsigned long long rng = 0x9e3779b97f4a7c15ull;
    unsigned long long cta_serial = 0;  // counts CTAs run, to tell one CTA's per-thread state from the next
    bool shuffle_ctas = false;          // run a launch's CTAs in a seeded random order, not x, y, z
};
static Runtime rt;
static float exchange[2][kMaxThreads];  // shuffle buffers, alternating by warp barrier generation

static inline unsigned long long next_random() {  // xorshift64
    rt.rng ^= rt.rng << 13;
    rt.rng ^= rt.rng >> 7;
    rt.rng ^= rt.rng << 17;
    return rt.rng;
}

static inline void yield() { swapcontext(&rt.fibers[rt.current], &rt.scheduler); }

static inline void wait(Barrier& b) {
    const unsigned long long gen = b.generation;
    ++rt.events;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == gen) yield();
}

// Value of `v` held by lane `src` of the caller's warp (all lanes must call).
static inline float exchange_lanes(float v, int src) {
    const unsigned tid = threadIdx.x, warp = tid / HAL_WARP_SIZE;
    Barrier& b = rt.warps[warp];
    const unsigned parity = b.generation & 1;
    exchange[parity][tid] = v;
    wait(b);
    return exchange[parity][warp * HAL_WARP_SIZE + (src & (HAL_WARP_SIZE - 1))];
}

static void fiber_entry() {
    rt.body(rt.arg);
    rt.done[rt.current] = 1;
    ++rt.events;
}  // returns to rt.scheduler through uc_link

// Runs body(arg) for every thread of every CTA.  0: ok, -1: bad block size,
// -2: deadlock (a barrier or shuffle not reached by all threads).
static int launch_threads(const unsigned* grid, const unsigned* block, void (*body)(void*), void* arg);
// HAL_HOST_FTZ=1 builds run kernels with the SSE flush-to-zero and denormals-are-zero modes
// on, as GPU code compiled with -ftz=true treats float32 subnormals (SSE applies them to
// double too, which is stricter than the GPU).
static int launch(const unsigned* grid, const unsigned* block, void (*body)(void*), void* arg) {
#if defined(HAL_HOST_FTZ) && HAL_HOST_FTZ
    const unsigned saved = __builtin_ia32_stmxcsr();
    __builtin_ia32_ldmxcsr(saved | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
    const int rc = launch_threads(grid, block, body, arg);
    __builtin_ia32_ldmxcsr(saved);
    return rc;
#else
    return launch_threads(grid, block, body, arg);
#endif
}

static int launch_threads(const unsigned* grid, const unsigned* block, void (*body)(void*), void* arg) {
    const unsigned nt = block[0];
    if (nt == 0 || nt > kMaxThreads || nt % HAL_WARP_SIZE || block[1] != 1 || block[2] != 1) return -1;
    rt.body = body;
    rt.arg = arg;
    while (rt.stacks.size() < nt) rt.stacks.emplace_back(new char[kStackBytes]);
    rt.fibers.resize(nt);
    rt.done.assign(nt, 0);
    rt.warps.assign(nt / HAL_WARP_SIZE, Barrier{HAL_WARP_SIZE, 0, 0});
    rt.cta = Barrier{nt, 0, 0};
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {nt, 1, 1};
    std::vector<unsigned> order(nt);
    const unsigned long long ctas = (unsigned long long)grid[0] * grid[1] * grid[2];
    std::vector<unsigned long long> schedule(ctas);
    for (unsigned long long c = 0; c < ctas; ++c) schedule[c] = c;
    if (rt.shuffle_ctas)
        for (unsigned long long i = ctas; i > 1; --i) {  // Fisher-Yates over the CTAs
            const unsigned long long j = next_random() % i, tmp = schedule[i - 1];
            schedule[i - 1] = schedule[j];
            schedule[j] = tmp;
        }
    for (const unsigned long long c : schedule) {
        blockIdx = {(unsigned)(c % grid[0]), (unsigned)(c / grid[0] % grid[1]),
                    (unsigned)(c / grid[0] / grid[1])};
        ++rt.cta_serial;
        for (unsigned t = 0; t < nt; ++t) {
            ucontext_t& f = rt.fibers[t];
            getcontext(&f);
            f.uc_stack.ss_sp = rt.stacks[t].get();
            f.uc_stack.ss_size = kStackBytes;
            f.uc_link = &rt.scheduler;
            makecontext(&f, fiber_entry, 0);
            rt.done[t] = 0;
            order[t] = t;
        }
        unsigned left = nt;
        while (left) {
            const unsigned long long before = rt.events;
            for (unsigned i = nt - 1; i > 0; --i) {  // Fisher-Yates
                const unsigned j = (unsigned)(next_random() % (i + 1));
                const unsigned tmp = order[i];
                order[i] = order[j];
                order[j] = tmp;
            }
            for (unsigned t : order) {
                if (rt.done[t]) continue;
                rt.current = t;
                threadIdx = {t, 0, 0};
                swapcontext(&rt.scheduler, &rt.fibers[t]);
                left -= rt.done[t];
            }
            if (left && rt.events == before) return -2;
        }
    }
    return 0;
}

// Calls a kernel-invoking lambda from launch().
template <typename F>
static int launch_lambda(const unsigned* grid, const unsigned* block, F f) {
    return launch(grid, block, [](void* p) { (*static_cast<F*>(p))(); }, &f);
}

}  // namespace hal_host

extern "C" void hal_host_seed(unsigned long long seed) { hal_host::rt.rng = seed | 1; }
extern "C" void hal_host_shuffle_ctas(int on) { hal_host::rt.shuffle_ctas = on != 0; }
extern "C" int hal_host_warp_size() { return HAL_WARP_SIZE; }

// The device spellings the kernels use.
HAL_DEVICE void hal_barrier() { hal_host::wait(hal_host::rt.cta); }
HAL_DEVICE float hal_shfl_xor(float v, int mask) {
    return hal_host::exchange_lanes(v, (int)(threadIdx.x % HAL_WARP_SIZE) ^ mask);
}
HAL_DEVICE float hal_shfl(float v, int src_lane) { return hal_host::exchange_lanes(v, src_lane); }
HAL_DEVICE hal_vec16 hal_load16(const void* p) {
    hal_vec16 v;
    std::memcpy(&v, p, 16);
    return v;
}
HAL_DEVICE float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
HAL_DEVICE float hal_bits_to_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
HAL_DEVICE unsigned hal_float_to_bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
// IEEE binary16 with round-to-nearest-even, as cvt.rn.f16.f32 / _Float16 on the GPU.
HAL_DEVICE float hal_half_to_float(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
HAL_DEVICE unsigned short hal_float_to_half(float f) {
    const _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}
HAL_DEVICE int hal_dot4_s8u8(int a, unsigned b, int c) {
    for (int i = 0; i < 4; ++i)
        c += (int)(signed char)((a >> (8 * i)) & 0xff) * (int)((b >> (8 * i)) & 0xffu);
    return c;
}
// Fibers switch only at synchronisation points, so a plain add is atomic here.
HAL_DEVICE float hal_atomic_add(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}

// Warp-level matrix instructions and cp.async (hal_mma.cuh), for 32-lane warps.
#if HAL_WARP_SIZE == 32
#include "mma_host.cuh"
#endif
