// The entry points of the compiled library: instruction-set selection, the thread pool,
// and the kernels that need no SIMD (write_kv_cache is a scatter of contiguous rows).
//
// Compiled for the portable baseline. Each SIMD variant of kernels.cpp is linked in when
// the build compiled it (HAL_HAVE_AVX512VNNI / HAL_HAVE_AVX512 / HAL_HAVE_AVX2); hal_cpu_select_isa
// picks the best one this CPU and OS support, unless a name is forced (HAL_CPU_ISA, for testing and diagnosis).
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "hal_cpu_kernels.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Thread pool: the calling thread works too; workers take tasks from an atomic counter.
//
// Waking a blocked worker costs 20-50 us on a virtual machine (a futex wake and an IPI to a halted
// vCPU), as much as a whole small op. So:
//  - after a job a worker polls for the next one for spin_us microseconds (hal_cpu_set_spin_us,
//    HAL_CPU_SPIN_US) before it blocks on a condition variable: back-to-back op calls find it
//    awake, and a pause between calls still leaves the cores to other runtimes' threads;
//  - a worker joins a job only while the caller is still taking tasks: once the caller has run out
//    of tasks it closes the job and waits only for the workers that joined, never for one still
//    waking up (which then goes back to waiting);
//  - the caller polls for the joined workers to finish before it blocks;
//  - a shared machine: a worker that got less than kStarvedShare of a core while it ran its tasks
//    (its thread CPU time against the wall clock, judged on tasks of kStarvedMinUs or more) was
//    descheduled by another process, and the caller waited for it. The next jobs then run on the
//    caller alone: 4 of them after the first such job, twice as many after each further one (up to
//    kMaxBackoff), and a job whose workers kept their cores ends the back-off. So a loaded machine
//    costs at most about the one-thread time, never a scheduler time slice per op call.
// ---------------------------------------------------------------------------------------------
using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Polls pred() for up to `us` microseconds; true as soon as it holds.
template <class Pred>
bool poll_for(int64_t us, Pred pred) {
    if (pred()) return true;
    if (us <= 0) return false;
    const Clock::time_point until = Clock::now() + std::chrono::microseconds(us);
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            cpu_relax();
            if (pred()) return true;
        }
        if (Clock::now() >= until) return false;
    }
}

std::atomic<int64_t> spin_us{100};
std::atomic<int> amx_allowed{1};  // hal_cpu_set_attention_amx
//: The caller polls this long for joined workers to finish before it blocks (it has nothing else to do).
constexpr int64_t kCallerPollUs = 2000;
//: A worker whose tasks took at least this long (wall clock) is judged for starvation...
constexpr int64_t kStarvedMinUs = 100;
//: ...and was starved when its thread ran for less than this share of that time.
constexpr double kStarvedShare = 0.75;
//: Jobs run on the caller alone after a starved one: 4, then doubling up to this.
constexpr int64_t kMaxBackoff = 256;

int64_t thread_cpu_ns() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

class Pool {
  public:
    explicit Pool(int workers) {
        for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { loop(); });
    }
    int size() const { return int(threads_.size()); }

    // Returns false when another job is running or the pool backs off after a starved worker (the caller
    // then runs its job inline).
    bool run(int64_t n, int helpers, void (*fn)(void *, int64_t), void *ctx) {
        std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        if (skip_ > 0) {
            --skip_;
            serial_jobs_.fetch_add(1, std::memory_order_relaxed);
            return false;
        }
        starved_.store(false, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(mu_);
            fn_ = fn;
            ctx_ = ctx;
            n_ = n;
            next_.store(0);
            seats_ = std::min(helpers, size());
            open_ = true;
            generation_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        work();
        {
            std::lock_guard<std::mutex> lock(mu_);
            open_ = false;  // no task is left: a worker not yet in has nothing to join
        }
        if (!poll_for(kCallerPollUs, [this] { return active_.load(std::memory_order_acquire) == 0; })) {
            std::unique_lock<std::mutex> lock(mu_);
            done_.wait(lock, [this] { return active_.load(std::memory_order_acquire) == 0; });
        }
        if (starved_.load(std::memory_order_relaxed)) {
            starved_jobs_.fetch_add(1, std::memory_order_relaxed);
            backoff_ = std::min(kMaxBackoff, backoff_ == 0 ? int64_t(4) : 2 * backoff_);
            skip_ = backoff_;
        } else {
            backoff_ = 0;
        }
        return true;
    }

    int64_t starved_jobs() const { return starved_jobs_.load(std::memory_order_relaxed); }
    int64_t serial_jobs() const { return serial_jobs_.load(std::memory_order_relaxed); }

  private:
    void work() {
        for (int64_t i; (i = next_.fetch_add(1)) < n_;) fn_(ctx_, i);
    }
    void loop() {
        uint64_t seen = 0;
        for (;;) {
            const auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
            if (!poll_for(spin_us.load(std::memory_order_relaxed), fresh)) {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, fresh);
            }
            {
                std::lock_guard<std::mutex> lock(mu_);
                seen = generation_.load(std::memory_order_relaxed);
                if (!open_ || seats_ == 0) continue;
                --seats_;
                active_.fetch_add(1, std::memory_order_relaxed);
            }
            const Clock::time_point wall0 = Clock::now();
            const int64_t cpu0 = thread_cpu_ns();
            work();
            const int64_t wall_ns =
                std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - wall0).count();
            if (wall_ns >= kStarvedMinUs * 1000 && double(thread_cpu_ns() - cpu0) < kStarvedShare * double(wall_ns))
                starved_.store(true, std::memory_order_relaxed);
            if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lock(mu_);
                done_.notify_all();
            }
        }
    }

    std::vector<std::thread> threads_;
    std::mutex submit_, mu_;
    std::condition_variable cv_, done_;
    void (*fn_)(void *, int64_t) = nullptr;
    void *ctx_ = nullptr;
    int64_t n_ = 0;
    std::atomic<int64_t> next_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> active_{0};
    int seats_ = 0;      // workers that may still join the current job (under mu_)
    bool open_ = false;  // whether the caller is still taking tasks (under mu_)
    std::atomic<bool> starved_{false};  // a worker of the current job lost its core
    int64_t backoff_ = 0, skip_ = 0;    // under submit_: the current back-off, and the jobs left in it
    std::atomic<int64_t> starved_jobs_{0}, serial_jobs_{0};
};

int cpu_count() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
}

std::mutex pool_mu;
Pool *pool = nullptr;  // made on first use; abandoned (not joined) in a forked child

void forget_pool_after_fork() { pool = nullptr; }

Pool *get_pool() {
    std::lock_guard<std::mutex> lock(pool_mu);
    if (!pool) {
        static bool registered = false;
        if (!registered) {
            pthread_atfork(nullptr, nullptr, forget_pool_after_fork);
            registered = true;
        }
        pool = new Pool(cpu_count() - 1);
    }
    return pool;
}

// ---------------------------------------------------------------------------------------------
// Instruction-set selection
// ---------------------------------------------------------------------------------------------
struct Variant {
    const char *name;
    const hal::KernelTable *(*table)();
    bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
}
#ifdef HAL_HAVE_AVX512VNNI
bool has_avx512vnni() {
    __builtin_cpu_init();
    return has_avx512() && __builtin_cpu_supports("avx512vnni");
}
#endif
bool has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx");
}
#endif
bool always() { return true; }

const Variant variants[] = {
#ifdef HAL_HAVE_AVX512VNNI
    {"avx512vnni", hal_kernels_avx512vnni, has_avx512vnni},
#endif
#ifdef HAL_HAVE_AVX512
    {"avx512", hal_kernels_avx512, has_avx512},
#endif
#ifdef HAL_HAVE_AVX2
    {"avx2", hal_kernels_avx2, has_avx2},
#endif
    {"baseline", hal_kernels_baseline, always},
};

const Variant *chosen = nullptr;

const hal::KernelTable *kernels() {
    if (!chosen) hal_cpu_select_isa(nullptr);
    return chosen->table();
}

}  // namespace

extern "C" {

void hal_cpu_parallel_for(int64_t n, int32_t threads, void (*fn)(void *, int64_t), void *ctx) {
    if (n <= 0) return;
    if (threads > 1 && n > 1) {
        Pool *p = get_pool();
        const int helpers = int(std::min<int64_t>(std::min(threads - 1, p->size()), n - 1));
        if (helpers > 0 && p->run(n, helpers, fn, ctx)) return;
    }
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

const char *hal_cpu_select_isa(const char *forced) {
    for (const Variant &v : variants) {
        if (forced && *forced && std::strcmp(forced, v.name) != 0) continue;
        if (v.supported()) {
            chosen = &v;
            return v.name;
        }
    }
    return nullptr;  // the forced variant is not built or not supported here: nothing changed
}

const char *hal_cpu_isa(void) {
    kernels();
    return chosen->name;
}

const char *hal_cpu_available_isas(void) {
    static std::string names;
    if (names.empty())
        for (const Variant &v : variants)
            if (v.supported()) names += std::string(names.empty() ? "" : ",") + v.name;
    return names.c_str();
}

int hal_cpu_default_threads(void) { return cpu_count(); }

void hal_cpu_pool_stats(int64_t *starved_jobs, int64_t *serial_jobs) {
    std::lock_guard<std::mutex> lock(pool_mu);
    *starved_jobs = pool ? pool->starved_jobs() : 0;
    *serial_jobs = pool ? pool->serial_jobs() : 0;
}

int64_t hal_cpu_set_spin_us(int64_t us) { return spin_us.exchange(std::max<int64_t>(0, us)); }

int hal_cpu_paged_attention(const hal_cpu_attention_args *args) { return kernels()->paged_attention(args); }

int hal_cpu_attention_amx(void) { return kernels()->attention_amx(); }

int hal_cpu_set_attention_amx(int enabled) { return amx_allowed.exchange(enabled != 0 ? 1 : 0); }

int hal_cpu_attention_amx_allowed(void) { return amx_allowed.load(std::memory_order_relaxed); }

const char *hal_cpu_abi(const char *name) {
    if (!name) return nullptr;
#define HAL_ABI_FIELD(type, f) out += std::string(";" #f "=") + std::to_string(offsetof(A, f)) + ":" + std::to_string(sizeof(A::f));
#define HAL_ABI_STRUCT(label, type, FIELDS)                                        \
    if (std::strcmp(name, #label) == 0) {                                          \
        static const std::string layout = [] {                                     \
            using A = type;                                                        \
            std::string out = "size=" + std::to_string(sizeof(A));                 \
            FIELDS(HAL_ABI_FIELD)                                                  \
            return out;                                                            \
        }();                                                                       \
        return layout.c_str();                                                     \
    }
    HAL_CPU_ABI_STRUCTS(HAL_ABI_STRUCT)
#undef HAL_ABI_STRUCT
#undef HAL_ABI_FIELD
    return nullptr;
}

int hal_cpu_to_float32(const hal_cpu_to_float32_args *args) { return kernels()->to_float32(args); }

int hal_cpu_w4a16_gemv(const hal_cpu_w4a16_gemv_args *args) { return kernels()->w4a16_gemv(args); }

int hal_cpu_dequant_tile(const hal_cpu_dequant_tile_args *args) { return kernels()->dequant_tile(args); }

int hal_cpu_w8a8_gemm(const hal_cpu_w8a8_gemm_args *args) { return kernels()->w8a8_gemm(args); }

int hal_cpu_w4a16_blocked(const hal_cpu_w4a16_blocked_args *args) { return kernels()->w4a16_blocked(args); }

int hal_cpu_w4a16_half_dot(void) { return kernels()->w4a16_half_dot(); }

int hal_cpu_w4a8_gemm(const hal_cpu_w4a8_gemm_args *args) { return kernels()->w4a8_gemm(args); }

int hal_cpu_write_kv_cache(const hal_cpu_write_kv_cache_args *args) {
    const hal_cpu_write_kv_cache_args &a = *args;
    const int64_t kts = a.k_token_stride, khs = a.k_head_stride, vts = a.v_token_stride, vhs = a.v_head_stride;
    const int64_t cb = a.c_block_stride, ch = a.c_head_stride, ct = a.c_token_stride, num_tokens = a.num_tokens;
    const int32_t num_kv_heads = a.num_kv_heads, block_size = a.block_size, elem_bytes = a.elem_bytes;
    const void *slots = a.slots;
    const int32_t slot_bytes = a.slot_bytes;
    const size_t row = size_t(a.head_size) * elem_bytes;
    const char *k = static_cast<const char *>(a.key), *v = static_cast<const char *>(a.value);
    char *kc = static_cast<char *>(a.key_cache), *vc = static_cast<char *>(a.value_cache);
    const int64_t per_task = 16;
    hal::parallel_for((num_tokens + per_task - 1) / per_task, a.threads, [&](int64_t t) {
        const int64_t i1 = std::min(num_tokens, (t + 1) * per_task);
        for (int64_t i = t * per_task; i < i1; ++i) {
            const int64_t slot = slot_bytes == 8 ? static_cast<const int64_t *>(slots)[i]
                                                 : static_cast<const int32_t *>(slots)[i];
            if (slot < 0) continue;
            const int64_t dst = (slot / block_size) * cb + (slot % block_size) * ct;
            for (int32_t h = 0; h < num_kv_heads; ++h) {
                std::memcpy(kc + (dst + h * ch) * elem_bytes, k + (i * kts + h * khs) * elem_bytes, row);
                std::memcpy(vc + (dst + h * ch) * elem_bytes, v + (i * vts + h * vhs) * elem_bytes, row);
            }
        }
    });
    return HAL_OK;
}

}  // extern "C"
