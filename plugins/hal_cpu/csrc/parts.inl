// parts.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// Small-M GEMV tasks over parts of K, and the per-thread workspaces of a parallel_for
// ---------------------------------------------------------------------------------------------
//
// The packed weight is [K rows, N] row-major, so a task that owns a column range reads one run of its
// width per row. With a narrow N (a 16 KiB int4 row, 4 KiB int8, split over the threads) those runs are
// short and the hardware prefetchers restart at every one. Cutting K into parts as well lets each task
// own whole rows of one part: long sequential runs. Each part sums its own rows; part 0 writes y, part
// p > 0 a slice of a small [parts - 1, M, N] buffer, and the parts are added to y in order at the end,
// so the result depends on the number of parts (fixed by the shape: ops/_rules.py), never on how the
// columns were tiled or how many threads ran.

// Per-thread workspaces of one parallel_for: at most `threads` tasks run at once (the pool's contract),
// so with that many slots acquire() always finds a free one. Allocated before any task runs, so a
// failed allocation is reported before anything is written (no exception leaves a pool thread).
class TaskSlots {
  public:
    explicit TaskSlots(int64_t count) : busy_(size_t(std::max<int64_t>(count, 1)), 0) {}
    int64_t count() const { return int64_t(busy_.size()); }
    int64_t acquire() {
        int64_t s = 0;
        while (__atomic_exchange_n(&busy_[size_t(s)], 1, __ATOMIC_ACQUIRE)) s = (s + 1) % count();
        return s;
    }
    void release(int64_t s) { __atomic_store_n(&busy_[size_t(s)], 0, __ATOMIC_RELEASE); }

  private:
    std::vector<int> busy_;
};

// The parts of K a small-M task set uses: at least 1, at most one per unit (group or segment) of K.
inline int64_t k_part_count(int32_t k_parts, int64_t units) {
    return std::max<int64_t>(1, std::min<int64_t>(k_parts, units));
}

// Runs task(p, c0, c1, out, scratch) for every part p of `parts` and column range [c0, c1) of [0, cols)
// cut in ranges of `tile`, out being where part p's m x n totals go (row stride n) and scratch the
// running task's own `scratch_floats` floats (uninitialised); then adds the parts to y in order,
// columns [0, cols). The tasks of part 0 come first, so threads start on different parts.
template <class Task>
void run_k_parts(int64_t parts, int64_t m, int64_t n, int64_t cols, int64_t tile, int64_t scratch_floats,
                 float *y, int32_t threads, Task &&task) {
    const int64_t ntiles = (cols + tile - 1) / tile, tasks = parts * ntiles;
    TaskSlots slots(std::min<int64_t>(tasks, std::max<int32_t>(threads, 1)));
    // Bounded by the output: per running task its scratch, and the totals of every part but the first
    // (each written whole before it is read).
    std::unique_ptr<float[]> scratch(new float[size_t(slots.count() * scratch_floats)]);
    std::unique_ptr<float[]> later(new float[size_t((parts - 1) * m * n)]);
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t p = t / ntiles, c0 = t % ntiles * tile, slot = slots.acquire();
        task(p, c0, std::min(cols, c0 + tile), p == 0 ? y : later.get() + (p - 1) * m * n,
             scratch.get() + slot * scratch_floats);
        slots.release(slot);
    });
    if (parts == 1) return;
    constexpr int64_t chunk = 1024;
    const int64_t chunks = (cols + chunk - 1) / chunk;
    parallel_for(m * chunks, threads, [&](int64_t t) {
        const int64_t r = t / chunks, c0 = t % chunks * chunk, c1 = std::min(cols, c0 + chunk);
        float *yr = y + r * n;
        for (int64_t p = 0; p + 1 < parts; ++p) {
            const float *src = later.get() + (p * m + r) * n;
            for (int64_t c = c0; c < c1; ++c) yr[c] += src[c];
        }
    });
}
