// expert_mlps.cpp: fused_moe's experts of few rows in one call (hal_cpu_expert_mlps, csrc/hal_cpu_kernels.h).
//
// Each job is one expert's w13 GEMM, gated activation and w2 GEMM, run through the library's own entry points
// (the selected variant's kernels) with threads = 1, so on the thread that took the job; the jobs are spread
// over the threads by one parallel job. Compiled for the base instruction set, like dispatch.cpp.

#include <atomic>
#include <cstdint>

#include "common.h"
#include "hal_cpu_kernels.h"

namespace {

// The kind's GEMM at base[j], on this thread alone.
template <class Args>
int expert_gemm(int (*kernel)(const Args *), const void *base, int64_t j) {
    Args args = static_cast<const Args *>(base)[j];
    args.threads = 1;
    return kernel(&args);
}

}  // namespace

extern "C" int hal_cpu_expert_mlps(const hal_cpu_expert_mlps_args *args) {
    const hal_cpu_expert_mlps_args &a = *args;
    std::atomic<int> rc{HAL_OK};
    auto gemm = [&](const void *base, int64_t j) {
        if (a.kind == HAL_EXPERT_W4A16) return expert_gemm(hal_cpu_w4a16_gemv, base, j);
        if (a.kind == HAL_EXPERT_W8A8) return expert_gemm(hal_cpu_w8a8_gemm, base, j);
        return expert_gemm(hal_cpu_w4a8_gemm, base, j);
    };
    hal::parallel_for(a.jobs, a.threads, [&](int64_t j) {
        int r = gemm(a.up, j);
        if (r == HAL_OK) {
            hal_cpu_gated_activation_args act = a.act[j];
            act.threads = 1;
            r = hal_cpu_gated_activation(&act);
        }
        if (r == HAL_OK) r = gemm(a.down, j);
        if (r != HAL_OK) rc = r;
    });
    return rc.load();
}
