// HIP prelude for the hal kernel sources (hipcc or hiprtc).
// Prepended to every kernel source before compilation; see README.md.
// Wavefront size defaults to 64 (CDNA); pass -DHAL_WARP_SIZE=32 for RDNA
// (gfx10/gfx11/gfx12), which compile in wave32 mode.
#pragma once
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#define HAL_PRELUDE 1
#define HAL_HIP 1

#ifndef HAL_WARP_SIZE
#define HAL_WARP_SIZE 64
#endif
#if HAL_WARP_SIZE != 32 && HAL_WARP_SIZE != 64
#error "HAL_WARP_SIZE must be 32 or 64"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != HAL_WARP_SIZE
#error "HAL_WARP_SIZE does not match the target's wavefront size"
#endif

#define HAL_DEVICE __device__ __forceinline__
#define HAL_GLOBAL extern "C" __global__
#define HAL_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define HAL_RESTRICT __restrict__

typedef uint4 hal_vec16;
typedef uint2 hal_vec8;

HAL_DEVICE void hal_barrier() { __syncthreads(); }

HAL_DEVICE float hal_shfl_xor(float v, int mask) {
    return __shfl_xor(v, mask, HAL_WARP_SIZE);
}
HAL_DEVICE float hal_shfl(float v, int src_lane) {
    return __shfl(v, src_lane, HAL_WARP_SIZE);
}

HAL_DEVICE hal_vec16 hal_load16(const void* p) {
    return *reinterpret_cast<const uint4*>(p);
}

HAL_DEVICE float hal_half_to_float(unsigned short h) {
    return static_cast<float>(__builtin_bit_cast(_Float16, h));
}
HAL_DEVICE unsigned short hal_float_to_half(float f) {
    return __builtin_bit_cast(unsigned short, static_cast<_Float16>(f));
}

HAL_DEVICE float hal_bits_to_float(unsigned int u) { return __uint_as_float(u); }
HAL_DEVICE unsigned int hal_float_to_bits(float f) { return __float_as_uint(f); }

HAL_DEVICE int hal_dot4_s8u8(int a, unsigned int b, int c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        c += static_cast<int>(static_cast<signed char>((a >> (8 * i)) & 0xff)) *
             static_cast<int>((b >> (8 * i)) & 0xffu);
    }
    return c;
}

HAL_DEVICE float hal_atomic_add(float* p, float v) { return atomicAdd(p, v); }
