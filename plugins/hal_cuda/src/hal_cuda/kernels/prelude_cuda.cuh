// CUDA prelude for the hal kernel sources (NVRTC or nvcc).
// Prepended to every kernel source before compilation; see README.md.
// Uses no headers: fp16/bf16 are handled as raw 16-bit storage.
#pragma once
#define HAL_PRELUDE 1
#define HAL_CUDA 1
#define HAL_MMA_SYNC 1  // the warp matrix instructions of hal_mma.cuh (mma.sync, ldmatrix, cp.async), sm_80+

#ifndef HAL_WARP_SIZE
#define HAL_WARP_SIZE 32
#endif
#if HAL_WARP_SIZE != 32
#error "CUDA warps have 32 lanes"
#endif

#define HAL_DEVICE __device__ __forceinline__
#define HAL_GLOBAL extern "C" __global__
#define HAL_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define HAL_RESTRICT __restrict__

typedef uint4 hal_vec16;  // 16-byte vector load/store type
typedef uint2 hal_vec8;

HAL_DEVICE void hal_barrier() { __syncthreads(); }

HAL_DEVICE float hal_shfl_xor(float v, int mask) {
    return __shfl_xor_sync(0xffffffffu, v, mask, HAL_WARP_SIZE);
}
HAL_DEVICE float hal_shfl(float v, int src_lane) {
    return __shfl_sync(0xffffffffu, v, src_lane, HAL_WARP_SIZE);
}

// Read-only cached load of 16 bytes.
HAL_DEVICE hal_vec16 hal_load16(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// IEEE half <-> float through the PTX conversion instructions.
HAL_DEVICE float hal_half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
HAL_DEVICE unsigned short hal_float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

HAL_DEVICE float hal_bits_to_float(unsigned int u) { return __uint_as_float(u); }
HAL_DEVICE unsigned int hal_float_to_bits(float f) { return __float_as_uint(f); }

// Dot product of four signed bytes (a) with four unsigned bytes (b), plus c.
HAL_DEVICE int hal_dot4_s8u8(int a, unsigned int b, int c) {
    int r;
    asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

HAL_DEVICE float hal_atomic_add(float* p, float v) { return atomicAdd(p, v); }
