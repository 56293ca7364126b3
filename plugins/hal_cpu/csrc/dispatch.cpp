// The entry points of the compiled library: instruction-set selection, the thread pool,
// and the kernels that need no SIMD (write_kv_cache is a scatter of contiguous rows).
//
// Compiled for the portable baseline. Each SIMD variant of kernels.cpp is linked in when
// the build compiled it (HAL_HAVE_AVX512VNNI / HAL_HAVE_AVX512 / HAL_HAVE_AVX2); hal_cpu_select_isa
// picks the best one this CPU and OS support, unless a name is forced (HAL_CPU_ISA, for testing and diagnosis).
#include <dlfcn.h>
#include <link.h>
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
// Parallel jobs. Every parallel region of the kernels is one call of hal_cpu_parallel_for(n, threads, fn,
// ctx): tasks 0..n-1 taken from one atomic counter (dynamic scheduling) by at most `threads` threads, the
// caller included. A job runs on one of two pools; the tasks, and so the results, are the same on both.
//
// The host pool. When the process has loaded an OpenMP runtime (torch's wheels bundle GNU libgomp; Intel's
// libiomp5 and LLVM's libomp export the same GOMP_parallel entry), a job runs as a parallel region of that
// runtime, its team threads taking the job's tasks. Such a runtime keeps its team polling for the next
// region after each one (libgomp's default active wait): hal's own workers would fight those threads for
// the cores, where on the host team the polling threads take hal's tasks at once. Found without loading
// anything: at each parallel job the count of libraries loaded so far (dl_iterate_phdr's adds counter) is
// compared with the one last scanned, and only a change scans the loaded libraries again; the first OpenMP
// runtime in load order is then kept for the life of the process (dlopen RTLD_NOLOAD holds it). So jobs
// move to the host pool at the first parallel job after the runtime was loaded. The team is the calling
// thread's (the runtime keeps one per thread that starts regions): torch's when torch and hal are called from
// the same thread. Inside an active OpenMP parallel region a job runs on the caller alone (never nested). A
// child forked after the library loaded never uses the runtime (libgomp's team does not survive fork): it
// makes its own pool. hal_cpu_set_host_pool(0) (HAL_CPU_HOST_POOL=0) keeps every job on the own pool, for
// diagnosis.
//
// The own pool: threads-1 of its cores-1 workers help the caller. Waking a blocked worker costs 20-50 us
// on a virtual machine (a futex wake and an IPI to a halted vCPU), as much as a whole small op. So:
//  - after a job a worker polls for the next one for spin_us microseconds (hal_cpu_set_spin_us,
//    HAL_CPU_SPIN_US) before it blocks on a condition variable: back-to-back op calls find it
//    awake, and a pause between calls still leaves the cores to other runtimes' threads;
//  - a worker joins a job only while the caller is still taking tasks: once the caller has run out
//    of tasks it closes the job and waits only for the workers that joined, never for one still
//    waking up (which then goes back to waiting);
//  - the caller polls for the joined workers to finish before it blocks.
//
// Both pools: one job at a time (a call made while another job runs, from another thread, runs on its
// own thread), and a back-off on a shared machine. A helper (own worker or host team thread) that got less
// than kStarvedShare of a core while it ran its tasks (its thread CPU time against the wall clock, judged
// on tasks of kStarvedMinUs or more), or a host team thread that joined more than kLateUs after the region
// began and found no task left (the caller waits for every team thread at the region's end), was
// descheduled by another process: the job was starved. After a starved job the next jobs go one step
// down for a back-off time -- from the host pool to the own pool (whose workers are never waited for),
// from the own pool to the caller alone -- kFirstBackoffUs after the first starved job, twice as long
// after each further one up to kMaxBackoffUs. The first job after it runs on the pool again (a probe); a
// probe whose helpers kept their cores ends that back-off (the next starved job starts again at
// kFirstBackoffUs). So a loaded machine costs about the one-thread time plus one starved probe per
// back-off time, never a scheduler time slice per op call, and jobs are back on their pool at most
// kMaxBackoffUs (and a probe or two) after the competition is gone.
// ---------------------------------------------------------------------------------------------
using Clock = std::chrono::steady_clock;
using Task = void (*)(void *, int64_t);

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
//: A helper whose tasks took at least this long (wall clock) is judged for starvation...
constexpr int64_t kStarvedMinUs = 100;
//: ...and was starved when its thread ran for less than this share of that time.
constexpr double kStarvedShare = 0.75;
//: A host team thread that joins this long after the region began, with no task left, was starved.
constexpr int64_t kLateUs = 1000;
//: Jobs run on the caller alone this long after a starved job, doubling per further one up to kMaxBackoffUs.
constexpr int64_t kFirstBackoffUs = 2000;
constexpr int64_t kMaxBackoffUs = 64000;

int64_t thread_cpu_ns() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Whether a helper that started its tasks at wall0 (thread CPU time cpu0) lost its core while it ran them.
bool lost_core(Clock::time_point wall0, int64_t cpu0) {
    const int64_t wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - wall0).count();
    return wall_ns >= kStarvedMinUs * 1000 && double(thread_cpu_ns() - cpu0) < kStarvedShare * double(wall_ns);
}

// The counters hal_cpu_pool_stats reports, in its order.
enum Counter { kStarved, kSerial, kOwn, kHost, kNested, kCounters };
static_assert(int(kCounters) == int(HAL_CPU_POOL_COUNTERS), "hal_cpu_pool_stats reports every counter");
std::atomic<int64_t> counters[kCounters];

void count(Counter c) { counters[c].fetch_add(1, std::memory_order_relaxed); }

class Pool {
  public:
    explicit Pool(int workers) {
        for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { loop(); });
    }
    int size() const { return int(threads_.size()); }

    // Runs the job with up to `helpers` workers besides the caller (one job at a time: the caller holds
    // Jobs::submit); returns whether a worker lost its core.
    bool run(int64_t n, int helpers, Task fn, void *ctx) {
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
        return starved_.load(std::memory_order_relaxed);
    }

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
            if (lost_core(wall0, cpu0)) starved_.store(true, std::memory_order_relaxed);
            if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lock(mu_);
                done_.notify_all();
            }
        }
    }

    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_, done_;
    Task fn_ = nullptr;
    void *ctx_ = nullptr;
    int64_t n_ = 0;
    std::atomic<int64_t> next_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> active_{0};
    int seats_ = 0;      // workers that may still join the current job (under mu_)
    bool open_ = false;  // whether the caller is still taking tasks (under mu_)
    std::atomic<bool> starved_{false};  // a worker of the current job lost its core
};

// ---- fork: a child abandons the parent's pool and never uses the parent's OpenMP runtime -------------------
struct Jobs;
std::mutex setup_mu;                // guards making `jobs`; held across fork (pthread_atfork)
std::atomic<Jobs *> jobs{nullptr};  // made on the first parallel job; abandoned (not joined) in a forked child
std::atomic<bool> forked_child{false};  // this process was forked after the library loaded

void before_fork() { setup_mu.lock(); }
void after_fork_in_parent() { setup_mu.unlock(); }
void after_fork_in_child() {
    setup_mu.unlock();
    jobs.store(nullptr);  // the parent's workers do not exist here, and its `submit` may be held
    forked_child.store(true);
}

// Registered when the library loads, so that every child forked after that is one.
const int fork_watched = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

// ---- the host pool: an OpenMP runtime the process has loaded --------------------------------------------
using GompParallel = void (*)(void (*)(void *), void *, unsigned, unsigned);
using OmpInParallel = int (*)();

struct HostRuntime {
    std::string path;
    GompParallel parallel;
    OmpInParallel in_parallel;
};

struct HostJob {
    Task fn;
    void *ctx;
    int64_t n;
    pthread_t caller;
    Clock::time_point begun;
    std::atomic<int64_t> next{0};
    std::atomic<bool> starved{false};
};

// The body of the region: every team thread takes tasks; the helpers are judged as the own pool's workers.
void host_region(void *data) {
    HostJob &job = *static_cast<HostJob *>(data);
    if (pthread_equal(pthread_self(), job.caller)) {
        for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) job.fn(job.ctx, i);
        return;
    }
    const Clock::time_point wall0 = Clock::now();
    const int64_t cpu0 = thread_cpu_ns();
    int64_t i = job.next.fetch_add(1);
    if (i >= job.n) {
        if (wall0 - job.begun > std::chrono::microseconds(kLateUs)) job.starved.store(true, std::memory_order_relaxed);
        return;
    }
    do job.fn(job.ctx, i);
    while ((i = job.next.fetch_add(1)) < job.n);
    if (lost_core(wall0, cpu0)) job.starved.store(true, std::memory_order_relaxed);
}

// Runs the job as a region of `team` threads of the host runtime; returns whether a helper lost its core.
bool run_on_host(const HostRuntime &host, int64_t n, int team, Task fn, void *ctx) {
    HostJob job{fn, ctx, n, pthread_self(), Clock::now()};
    host.parallel(host_region, &job, unsigned(team), 0);
    return job.starved.load(std::memory_order_relaxed);
}

// A library of an OpenMP runtime that exports GOMP_parallel: libgomp*, libiomp5*, libomp* (a '.' or '-' after
// the name: torch's wheels rename theirs libgomp-<hash>.so.1).
bool is_openmp_runtime(const char *path) {
    const char *slash = std::strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    for (const char *name : {"libgomp", "libiomp5", "libomp"}) {
        const size_t len = std::strlen(name);
        if (std::strncmp(base, name, len) == 0 && (base[len] == '.' || base[len] == '-')) return true;
    }
    return false;
}

int read_adds(dl_phdr_info *info, size_t size, void *data) {
    if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds))
        *static_cast<unsigned long long *>(data) = info->dlpi_adds;
    return 1;  // the counter is the same on every object: the first is enough
}

int collect_runtimes(dl_phdr_info *info, size_t, void *data) {
    if (info->dlpi_name && *info->dlpi_name && is_openmp_runtime(info->dlpi_name))
        static_cast<std::vector<std::string> *>(data)->push_back(info->dlpi_name);
    return 0;
}

std::atomic<int> host_allowed{1};               // hal_cpu_set_host_pool
std::atomic<const HostRuntime *> host{nullptr};  // found, kept for the life of the process
std::atomic<unsigned long long> scanned_adds{0};  // the loaded-library count last scanned (0: never)
std::mutex scan_mu;

// The host runtime jobs run on, or nullptr (none loaded, turned off, or a forked child). Cheap when nothing
// was loaded since the last call: one dl_iterate_phdr step.
const HostRuntime *host_runtime() {
    if (!host_allowed.load(std::memory_order_relaxed) || forked_child.load(std::memory_order_relaxed)) return nullptr;
    if (const HostRuntime *h = host.load(std::memory_order_acquire)) return h;
    unsigned long long adds = 0;
    dl_iterate_phdr(read_adds, &adds);
    if (adds == scanned_adds.load(std::memory_order_relaxed)) return nullptr;
    std::lock_guard<std::mutex> lock(scan_mu);
    if (const HostRuntime *h = host.load(std::memory_order_acquire)) return h;
    scanned_adds.store(adds, std::memory_order_relaxed);
    std::vector<std::string> paths;
    dl_iterate_phdr(collect_runtimes, &paths);
    for (const std::string &path : paths) {
        void *handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // already loaded: loads nothing
        if (!handle) continue;
        void *parallel = dlsym(handle, "GOMP_parallel"), *in_parallel = dlsym(handle, "omp_in_parallel");
        if (parallel && in_parallel) {
            const HostRuntime *h = new HostRuntime{path, reinterpret_cast<GompParallel>(parallel),
                                                   reinterpret_cast<OmpInParallel>(in_parallel)};
            host.store(h, std::memory_order_release);
            return h;
        }
        dlclose(handle);
    }
    return nullptr;
}

// ---- one job at a time, the back-off, the own pool ------------------------------------------------------
int cpu_count() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
}

// A back-off (under Jobs::submit): after a starved job, `until` is kFirstBackoffUs later, doubling per further
// starved job up to kMaxBackoffUs; a job that was not starved ends it.
struct Backoff {
    int64_t us = 0;  // 0: none
    Clock::time_point until{};

    bool active(Clock::time_point now) const { return us > 0 && now < until; }
    void after(bool starved) {
        if (!starved) {
            us = 0;
            return;
        }
        count(kStarved);
        us = us == 0 ? kFirstBackoffUs : std::min(kMaxBackoffUs, 2 * us);
        until = Clock::now() + std::chrono::microseconds(us);
    }
};

struct Jobs {
    const int cores = cpu_count();  // the most threads a job runs on
    std::mutex submit;              // held by the caller of the running job
    Backoff serial;                 // under submit: jobs run on the caller alone (after a starved own-pool job)
    Backoff own;                    // under submit: jobs run on the own pool (after a starved host-pool job)
    Pool *pool = nullptr;           // under submit: the own pool, made on its first job
};

Jobs &get_jobs() {
    if (Jobs *j = jobs.load(std::memory_order_acquire)) return *j;
    std::lock_guard<std::mutex> lock(setup_mu);
    if (!jobs.load(std::memory_order_relaxed)) jobs.store(new Jobs, std::memory_order_release);
    return *jobs.load(std::memory_order_relaxed);
}

// Runs the job on up to `threads` threads (2 <= threads <= n); false when it must run on the caller alone
// (inside an OpenMP region, another job running, a back-off, or a one-core pool).
bool run_parallel(int64_t n, int threads, Task fn, void *ctx) {
    const HostRuntime *h = host_runtime();
    if (h && h->in_parallel()) {
        count(kNested);
        return false;
    }
    Jobs &j = get_jobs();
    std::unique_lock<std::mutex> busy(j.submit, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const Clock::time_point now = Clock::now();
    if (j.serial.active(now)) {
        count(kSerial);
        return false;
    }
    const int team = std::min(threads, j.cores);
    if (team < 2) return false;
    if (h && !j.own.active(now)) {
        count(kHost);
        j.own.after(run_on_host(*h, n, team, fn, ctx));
        return true;
    }
    if (!j.pool) j.pool = new Pool(j.cores - 1);
    const int helpers = std::min(team - 1, j.pool->size());
    if (helpers <= 0) return false;
    count(kOwn);
    j.serial.after(j.pool->run(n, helpers, fn, ctx));
    return true;
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
    if (threads > 1 && n > 1 && run_parallel(n, int(std::min<int64_t>(threads, n)), fn, ctx)) return;
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

void hal_cpu_pool_stats(int64_t *counts, int32_t n) {
    for (int32_t i = 0; i < std::min<int32_t>(n, kCounters); ++i) counts[i] = counters[i].load(std::memory_order_relaxed);
}

const char *hal_cpu_host_runtime(void) {
    const HostRuntime *h = host_runtime();
    return h ? h->path.c_str() : nullptr;
}

int hal_cpu_set_host_pool(int enabled) { return host_allowed.exchange(enabled != 0 ? 1 : 0); }

void hal_cpu_pool_note_starved(int host) {
    Jobs &j = get_jobs();
    std::lock_guard<std::mutex> lock(j.submit);
    (host ? j.own : j.serial).after(true);
}

int64_t hal_cpu_set_spin_us(int64_t us) { return spin_us.exchange(std::max<int64_t>(0, us)); }

int hal_cpu_paged_attention(const hal_cpu_attention_args *args) { return kernels()->paged_attention(args); }

int hal_cpu_attention_amx(void) { return kernels()->attention_amx(); }

int hal_cpu_gemm_amx(void) { return kernels()->gemm_amx(); }

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
int hal_cpu_from_float32(const hal_cpu_from_float32_args *args) { return kernels()->from_float32(args); }

int hal_cpu_w4a16_gemv(const hal_cpu_w4a16_gemv_args *args) { return kernels()->w4a16_gemv(args); }

int hal_cpu_dequant_tile(const hal_cpu_dequant_tile_args *args) { return kernels()->dequant_tile(args); }

int hal_cpu_w8a8_gemm(const hal_cpu_w8a8_gemm_args *args) { return kernels()->w8a8_gemm(args); }

int hal_cpu_w4a16_blocked(const hal_cpu_w4a16_blocked_args *args) { return kernels()->w4a16_blocked(args); }

int hal_cpu_w4a16_half_dot(void) { return kernels()->w4a16_half_dot(); }

int hal_cpu_w4a8_gemm(const hal_cpu_w4a8_gemm_args *args) { return kernels()->w4a8_gemm(args); }

int hal_cpu_sample(const hal_cpu_sample_args *args) { return kernels()->sample(args); }
int hal_cpu_rms_norm(const hal_cpu_rms_norm_args *args) { return kernels()->rms_norm(args); }

int hal_cpu_gated_activation(const hal_cpu_gated_activation_args *args) { return kernels()->gated_activation(args); }
int hal_cpu_rotary_embedding(const hal_cpu_rotary_embedding_args *args) { return kernels()->rotary_embedding(args); }

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
