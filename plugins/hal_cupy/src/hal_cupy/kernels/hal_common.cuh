// Vendor-neutral helpers shared by all hal kernels.
// A vendor prelude (prelude_cuda.cuh / prelude_hip.cuh) must come first.
#pragma once
#ifndef HAL_PRELUDE
#error "prepend prelude_cuda.cuh or prelude_hip.cuh before the kernel source"
#endif

// Element type codes used by HAL_DTYPE.
#define HAL_F32 0
#define HAL_F16 1
#define HAL_BF16 2

typedef unsigned char hal_u8;
typedef signed char hal_i8;
typedef unsigned short hal_u16;
typedef unsigned int hal_u32;
typedef long long hal_i64;

#define HAL_NEG_INF (__int_as_float(0xff800000))

HAL_DEVICE float hal_bf16_to_float(hal_u16 h) {
    return hal_bits_to_float(static_cast<hal_u32>(h) << 16);
}
// Round to nearest even; NaN stays a (quiet) NaN.
HAL_DEVICE hal_u16 hal_float_to_bf16(float f) {
    hal_u32 u = hal_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<hal_u16>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<hal_u16>(u >> 16);
}

#ifdef HAL_DTYPE
// Storage type and conversions of the HAL_DTYPE element type.
#if HAL_DTYPE == HAL_F32
typedef float hal_t;
HAL_DEVICE float hal_to_float(hal_t v) { return v; }
HAL_DEVICE hal_t hal_from_float(float v) { return v; }
#elif HAL_DTYPE == HAL_F16
typedef hal_u16 hal_t;
HAL_DEVICE float hal_to_float(hal_t v) { return hal_half_to_float(v); }
HAL_DEVICE hal_t hal_from_float(float v) { return hal_float_to_half(v); }
#elif HAL_DTYPE == HAL_BF16
typedef hal_u16 hal_t;
HAL_DEVICE float hal_to_float(hal_t v) { return hal_bf16_to_float(v); }
HAL_DEVICE hal_t hal_from_float(float v) { return hal_float_to_bf16(v); }
#else
#error "HAL_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

// Elements per 16-byte vector.
#define HAL_EPV (16 / (int)sizeof(hal_t))

// Unpack a 16-byte vector of HAL_DTYPE elements into HAL_EPV floats.
HAL_DEVICE void hal_unpack16(const hal_vec16& v, float* out) {
    const hal_u32 w[4] = {v.x, v.y, v.z, v.w};
#if HAL_DTYPE == HAL_F32
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = hal_bits_to_float(w[i]);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = hal_to_float(static_cast<hal_t>(w[i] & 0xffffu));
        out[2 * i + 1] = hal_to_float(static_cast<hal_t>(w[i] >> 16));
    }
#endif
}
#endif  // HAL_DTYPE

HAL_DEVICE float hal_warp_sum(float v) {
#pragma unroll
    for (int m = HAL_WARP_SIZE / 2; m > 0; m >>= 1) v += hal_shfl_xor(v, m);
    return v;
}
HAL_DEVICE float hal_warp_max(float v) {
#pragma unroll
    for (int m = HAL_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, hal_shfl_xor(v, m));
    return v;
}

// v * s for a scale s that may be float32-subnormal (the W8A8 row scale's floor is 2^-149), equal to
// the IEEE product whenever that product is a normal float.  Builds with flush-to-zero (CuPy's default,
// -ftz=true) flush a subnormal operand to 0, so a subnormal s is rebuilt from its integer mantissa m
// (s = m * 2^-149) as the normal m * 2^-85 and the product scaled by 2^-64 afterwards (exact, one rounding).
HAL_DEVICE float hal_mul_scale_ftz_safe(float v, float s) {
    const hal_u32 b = hal_float_to_bits(s);
    if ((b & 0x7f800000u) != 0) return v * s;  // normal, infinite or NaN
    const float m = (float)(b & 0x007fffffu) * 0x1p-85f;
    const float p = v * ((b >> 31) ? -m : m);
    return p * 0x1p-64f;
}
