// Self-check of prelude_host.cuh, built first: if this fails to compile or
// misbehaves, the host-compiled kernel tests are skipped (compile) or fail.
#include "prelude_host.cuh"

// out[t] = lane (t ^ 1)'s value after a CTA barrier, for 2 warps.
static void shuffle_kernel(float* out) {
    const float v = hal_shfl_xor((float)threadIdx.x, 1);
    hal_barrier();
    out[threadIdx.x] = v;
}

// Thread 0 skips the barrier the others wait at.
static void divergent_barrier_kernel() {
    if (threadIdx.x != 0) hal_barrier();
}

extern "C" int probe_shuffle(float* out) {
    const unsigned grid[3] = {1, 1, 1}, block[3] = {2 * HAL_WARP_SIZE, 1, 1};
    return hal_host::launch_lambda(grid, block, [=] { shuffle_kernel(out); });
}

extern "C" int probe_deadlock() {
    const unsigned grid[3] = {2, 1, 1}, block[3] = {HAL_WARP_SIZE, 1, 1};
    return hal_host::launch_lambda(grid, block, [] { divergent_barrier_kernel(); });
}
