// HIP prelude for the hal kernel sources (hipcc or hiprtc).
// Prepended to every kernel source before compilation; see README.md.
// Wavefront size defaults to 64 (CDNA); the shared layer always passes -DHAL_WARP_SIZE from the device's
// warpSize: 32 for RDNA (gfx10/gfx11/gfx12, wave32 under HIP), 64 for CDNA. A mismatch with the target's
// wavefront is a compile error here, and a launch refused by the launcher.
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

// Dot product of four signed bytes (a) with four unsigned bytes (b), plus c, on the target's dot-product unit:
// RDNA3/RDNA4 have a mixed-sign v_dot4_i32_iu8 (dot8-insts); CDNA2/CDNA3 have only the signed v_dot4_i32_i8
// (dot1-insts), so b is re-centred: a.b = a.(b - 128) + 128 * sum(a), both signed dot products.
HAL_DEVICE int hal_dot4_s8u8(int a, unsigned int b, int c) {
#if defined(__GFX11__) || defined(__GFX12__)
    return __builtin_amdgcn_sudot4(true, a, false, static_cast<int>(b), c, false);
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || \
    defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)
    const int sum_a = __builtin_amdgcn_sdot4(a, 0x01010101, 0, false);
    return __builtin_amdgcn_sdot4(a, static_cast<int>(b ^ 0x80808080u), c + 128 * sum_a, false);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        c += static_cast<int>(static_cast<signed char>((a >> (8 * i)) & 0xff)) *
             static_cast<int>((b >> (8 * i)) & 0xffu);
    }
    return c;
#endif
}

// A hardware float atomic: compiled with -munsafe-fp-atomics (RocmPlatform's options) this is
// global_atomic_add_f32 on CDNA2/CDNA3 rather than a compare-and-swap loop; exact on device memory.
HAL_DEVICE float hal_atomic_add(float* p, float v) { return atomicAdd(p, v); }
