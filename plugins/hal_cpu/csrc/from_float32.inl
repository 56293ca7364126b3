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
#if defined(HAL_ISA_AVX512)
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i sign = _mm512_set1_epi32(0x8000), quiet = _mm512_set1_epi32(0x7fc0);
    for (; e + 16 <= n; e += 16) {
        const __m512 v = _mm512_loadu_ps(x + e);
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i high = _mm512_srli_epi32(bits, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, _mm512_and_si512(high, one))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_and_si512(high, sign), quiet));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + e), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; e < n; ++e) out[e] = f32_to_bf16_rne(x[e]);
}

inline void f32_to_f16_span(const float *x, uint16_t *out, int64_t n) {
    int64_t e = 0;
#if defined(HAL_ISA_AVX512)
    for (; e + 16 <= n; e += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + e),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
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
