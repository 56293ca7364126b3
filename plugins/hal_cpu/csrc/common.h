// Shared by every kernel variant: the thread pool's entry point (defined once, in dispatch.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "hal_cpu_kernels.h"

extern "C" void hal_cpu_parallel_for(int64_t n, int32_t threads, void (*fn)(void *, int64_t), void *ctx);
// Whether attention may use AMX tiles where the CPU and the OS allow it (hal_cpu_set_attention_amx; default 1).
extern "C" int hal_cpu_attention_amx_allowed(void);

namespace hal {

// Run f(i) for i in [0, n) on up to `threads` threads (dynamic scheduling; the caller works too).
template <class F>
inline void parallel_for(int64_t n, int32_t threads, F &&f) {
    using Fn = std::remove_reference_t<F>;
    hal_cpu_parallel_for(n, threads, [](void *ctx, int64_t i) { (*static_cast<Fn *>(ctx))(i); }, &f);
}

// The kernels of one instruction-set variant; dispatch.cpp holds one table per compiled variant.
struct KernelTable {
    int (*paged_attention)(const hal_cpu_attention_args *);
    int (*attention_amx)();
    int (*to_float32)(const hal_cpu_to_float32_args *);
    int (*w4a16_gemv)(const hal_cpu_w4a16_gemv_args *);
    int (*dequant_tile)(const hal_cpu_dequant_tile_args *);
    int (*w8a8_gemm)(const hal_cpu_w8a8_gemm_args *);
    int (*w4a16_blocked)(const hal_cpu_w4a16_blocked_args *);
    int (*w4a16_half_dot)();
    int (*w4a8_gemm)(const hal_cpu_w4a8_gemm_args *);
    int (*sample)(const hal_cpu_sample_args *);
    int (*rms_norm)(const hal_cpu_rms_norm_args *);
    int (*gated_activation)(const hal_cpu_gated_activation_args *);
    int (*rotary_embedding)(const hal_cpu_rotary_embedding_args *);
    int (*gemm_amx)();
    int (*from_float32)(const hal_cpu_from_float32_args *);
};

}  // namespace hal

extern "C" const hal::KernelTable *hal_kernels_avx512vnni();
extern "C" const hal::KernelTable *hal_kernels_avx512();
extern "C" const hal::KernelTable *hal_kernels_avx2();
extern "C" const hal::KernelTable *hal_kernels_baseline();
