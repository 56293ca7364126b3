// hal-cpu's kernels, written once against the vector layer in isa.h.
//
// This file is compiled once per instruction-set variant (see setup.py); each
// compilation defines its kernels in namespace hal::<variant> and exports one
// KernelTable through hal_kernels_<variant>(). dispatch.cpp picks the table at
// load time. Nothing here allocates more than the bounded workspaces named in
// docs/cpu.md, and every kernel reads its operands in their storage dtype.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "common.h"
#include "hal_cpu_kernels.h"
#include "isa.h"

namespace hal {
namespace HAL_ISA_NAME {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int W = V::W;

template <class S>
inline V::f vload(const typename S::T *p) {
    return V::load(static_cast<const S *>(nullptr), p);
}

#include "paged_attention.inl"
#include "activations.inl"
#include "parts.inl"
#include "w4a16.inl"
#include "dequant.inl"
#include "w4_blocked.inl"
#include "w8a8.inl"
#include "w4a8.inl"
#include "sample.inl"
#include "rms_norm.inl"
#include "gated_activation.inl"
#include "rotary_embedding.inl"
#include "from_float32.inl"

const KernelTable table = {paged_attention, attention_amx_enabled, to_float32, w4a16_gemv, dequant_tile, w8a8_gemm,
                           w4a16_blocked,
                           w4a16_half_dot, w4a8_gemm,
                           sample, rms_norm, gated_activation, rotary_embedding, gemm_amx_enabled,
                           from_float32};

}  // namespace HAL_ISA_NAME
}  // namespace hal

#define HAL_CONCAT2(a, b) a##b
#define HAL_CONCAT(a, b) HAL_CONCAT2(a, b)

extern "C" const hal::KernelTable *HAL_CONCAT(hal_kernels_, HAL_ISA_NAME)() { return &hal::HAL_ISA_NAME::table; }
