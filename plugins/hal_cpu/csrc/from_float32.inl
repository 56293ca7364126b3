// from_float32.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// float32 results rounded to fp16 / bf16 (what numpy's astype gives, in parallel)
// ---------------------------------------------------------------------------------------------
// Round to nearest even, as numpy's float16 and ml_dtypes' bfloat16 casts do: fp16 through the FPU's conversion
// (subnormals kept, overflow to inf), bf16 by the carry trick on the bits with a NaN made the canonical quiet NaN
// of its sign (0x7fc0 / 0xffc0, as ml_dtypes). Chunks of `chunk` elements run as parallel tasks.

inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t(((x >> 16) & 0x8000u) | 0x7fc0u);
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline void f32_to_bf16_span(const float *x, uint16_t *out, int64_t n) {
    int64_t e = 0;
#if defined(HAL_HALF_LANES)
    for (; e + W <= n; e += W) bf16_rne_lanes(x + e, out + e, true);
#endif
    for (; e < n; ++e) out[e] = f32_to_bf16_rne(x[e]);
}

inline void f32_to_f16_span(const float *x, uint16_t *out, int64_t n) {
    int64_t e = 0;
#if defined(HAL_HALF_LANES)
    for (; e + W <= n; e += W) f16_rne_lanes(x + e, out + e);
#endif
    for (; e < n; ++e) out[e] = f32_to_f16_bits(x[e]);
}

int from_float32(const hal_cpu_from_float32_args *args) {
    const hal_cpu_from_float32_args &a = *args;
    const int64_t chunk = std::max<int64_t>(1, a.chunk);
    uint16_t *out = static_cast<uint16_t *>(a.out);
    parallel_for((a.n + chunk - 1) / chunk, a.threads, [&](int64_t t) {
        const int64_t e0 = t * chunk, count = std::min(a.n, e0 + chunk) - e0;
        if (a.dtype == HAL_F16) f32_to_f16_span(a.x + e0, out + e0, count);
        else f32_to_bf16_span(a.x + e0, out + e0, count);
    });
    return HAL_OK;
}
