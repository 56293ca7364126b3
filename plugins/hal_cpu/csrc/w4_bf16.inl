// w4_bf16.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A16 small M with fp16/bf16 activations: int4 codes as bf16 pairs, AVX512_BF16 dot products
// ---------------------------------------------------------------------------------------------
//
// Only in the avx512 variant, and only where the CPU has AVX512_BF16 (checked at run time; the
// functions carry their own target attribute, the rest of the variant does not assume it).
//
// Word [r, n] holds codes of rows 8r..8r+7 in nibbles 0..7. Shifting the 32-bit word and keeping
// bits 3..6 and 19..22 puts nibble j in the low 16-bit half and nibble j+4 in the high half, at
// the top of a bf16 mantissa: with the exponent of 1.0 OR-ed in, each half is the bf16 value
// 1 + q/16, exactly. vdpbf16ps multiplies such a pair by the pair (x[8r+j], x[8r+4+j]) and adds
// both products to a float32 lane: 32 codes per instruction, two instructions (shift, ternary
// logic) to unpack 32 codes. Per group: sum x q = 16 (S - sum x) where S = sum x (1 + q/16),
// so y += s (16 S - (16 + z) sum x).
//
// Activations are split exactly into bf16 parts: a bf16 x is one part; an fp16 x (11 significant
// bits) is hi + lo, hi its top 8 bits and lo the rest (at most 3 bits: exact in bf16). Products of
// bf16 values are exact in float32, sums are float32 (vdpbf16ps treats bf16 subnormal inputs,
// below 2**-126, as zero: far below every tolerance). A non-finite x makes the row non-finite
// (the bias 1 + q/16 is never zero), which the wrapper redoes through the IEEE blocked kernel.

#if defined(HAL_ISA_AVX512)
#define HAL_W4_BF16 1
#define HAL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

inline bool cpu_has_avx512_bf16() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has;
}


// The 16-bit pair words of x for one row: parts[p * 4 + j] = part(x[8p + j]) | part(x[8p + 4 + j]) << 16.
inline void w4_bf16_pairs(const float *x32, int64_t k, bool split, uint32_t *hi, uint32_t *lo) {
    for (int64_t p = 0; p < k / 8; ++p)
        for (int j = 0; j < 4; ++j) {
            uint32_t h[2], l[2];
            for (int half = 0; half < 2; ++half) {
                const float v = x32[8 * p + j + 4 * half];
                uint32_t bits;
                std::memcpy(&bits, &v, 4);
                h[half] = bits >> 16;  // exact for bf16 inputs; the top 8 significant bits of an fp16 one
                float hv, rest;
                const uint32_t hb = bits & 0xFFFF0000u;
                std::memcpy(&hv, &hb, 4);
                rest = v - hv;  // exact: at most 3 significant bits of an fp16 value
                uint32_t rb;
                std::memcpy(&rb, &rest, 4);
                l[half] = rb >> 16;
            }
            hi[p * 4 + j] = h[0] | (h[1] << 16);
            if (split) lo[p * 4 + j] = l[0] | (l[1] << 16);
        }
}

template <int S>
HAL_BF16_TARGET inline __m512i w4_bf16_codes(__m512i w) {
    // (w shifted so nibble j sits at bits 3..6) & 0x00780078 | 0x3F803F80: bf16 pairs 1 + q/16.
    const __m512i mask = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
    const __m512i t = S >= 0 ? _mm512_slli_epi32(w, S >= 0 ? S : 0) : _mm512_srli_epi32(w, S < 0 ? -S : 0);
    return _mm512_ternarylogic_epi32(t, mask, one, 0xEA);  // (a & b) | c
}

// Columns [n0, n0 + 16 NV) of MB rows; totals accumulate in y (zeroed by the caller's first group).
template <class SS, int MB, int NV, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_tile(const uint32_t *hi, const uint32_t *lo, int64_t pstride, const float *xsum,
                                  int64_t ngroups, const uint32_t *qw, int64_t n, int64_t n0,
                                  const typename SS::T *scales, const uint8_t *zeros, float zdef, int64_t gsize,
                                  float *y, int64_t ldy) {
    const int64_t words = gsize / 8;
    __m512 tot[MB][NV];
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) tot[mb][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; ++g) {
        __m512 acc[MB][NV];
        for (int mb = 0; mb < MB; ++mb)
            for (int v = 0; v < NV; ++v) acc[mb][v] = _mm512_setzero_ps();
        for (int64_t r = g * words; r < (g + 1) * words; ++r) {
            const uint32_t *wrow = qw + r * n + n0;
            __m512i w[NV];
            for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wrow + v * 16);
#define HAL_W4_BF16_STEP(J, S)                                                                               \
    {                                                                                                        \
        __m512i b[NV];                                                                                       \
        for (int v = 0; v < NV; ++v) b[v] = w4_bf16_codes<S>(w[v]);                                          \
        for (int mb = 0; mb < MB; ++mb) {                                                                    \
            const __m512bh xh = (__m512bh)_mm512_set1_epi32(int(hi[mb * pstride + r * 4 + J]));              \
            for (int v = 0; v < NV; ++v) acc[mb][v] = _mm512_dpbf16_ps(acc[mb][v], (__m512bh)b[v], xh);     \
            if (SPLIT) {                                                                                     \
                const __m512bh xl = (__m512bh)_mm512_set1_epi32(int(lo[mb * pstride + r * 4 + J]));          \
                for (int v = 0; v < NV; ++v) acc[mb][v] = _mm512_dpbf16_ps(acc[mb][v], (__m512bh)b[v], xl); \
            }                                                                                                \
        }                                                                                                    \
    }
            HAL_W4_BF16_STEP(0, 3)
            HAL_W4_BF16_STEP(1, -1)
            HAL_W4_BF16_STEP(2, -5)
            HAL_W4_BF16_STEP(3, -9)
#undef HAL_W4_BF16_STEP
        }
        for (int v = 0; v < NV; ++v) {
            const int64_t col = g * n + n0 + v * 16;
            const __m512 s = vload<SS>(scales + col);
            const __m512 z16 = _mm512_add_ps(zeros ? V::load_u8(zeros + col) : _mm512_set1_ps(zdef),
                                             _mm512_set1_ps(16.0f));
            for (int mb = 0; mb < MB; ++mb) {
                const __m512 t = _mm512_fnmadd_ps(z16, _mm512_set1_ps(xsum[mb * ngroups + g]),
                                                  _mm512_mul_ps(_mm512_set1_ps(16.0f), acc[mb][v]));
                tot[mb][v] = _mm512_fmadd_ps(s, t, tot[mb][v]);
            }
        }
    }
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + mb * ldy + n0 + v * 16, tot[mb][v]);
}

template <class SS, int NV, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_rows(int64_t m, const uint32_t *hi, const uint32_t *lo, int64_t pstride,
                                  const float *xsum, int64_t ngroups, const uint32_t *qw, int64_t n, int64_t n0,
                                  const typename SS::T *sc, const uint8_t *zeros, float zdef, int64_t gsize,
                                  float *y) {
    constexpr int MB = NV >= 4 ? 1 : 4;  // accumulators and totals within the 32 zmm registers (6, 8: no faster)
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r;
#define HAL_W4_BF16_ROWS(R)                                                                                    \
    w4_bf16_tile<SS, R, NV, SPLIT>(hi + r * pstride, SPLIT ? lo + r * pstride : nullptr, pstride,              \
                                   xsum + r * ngroups, ngroups, qw, n, n0, sc, zeros, zdef, gsize, y + r * n, n)
        if (left >= MB) { HAL_W4_BF16_ROWS(MB); r += MB; }
        else if (MB >= 2 && left >= 2) { HAL_W4_BF16_ROWS(MB >= 2 ? 2 : 1); r += 2; }
        else { HAL_W4_BF16_ROWS(1); r += 1; }
#undef HAL_W4_BF16_ROWS
    }
}

template <class SS, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_columns(int64_t m, const uint32_t *hi, const uint32_t *lo, int64_t pstride,
                                     const float *xsum, int64_t ngroups, const uint32_t *qw, int64_t n,
                                     const typename SS::T *sc, const uint8_t *zeros, float zdef, int64_t gsize,
                                     float *y, int64_t n_tile, int32_t threads) {
    const int64_t nv = m <= 2 ? 8 : 2;  // 8: measured faster than 4 or 16 here
    const int64_t step = nv * 16;
    const int64_t full = n / step * step;
    const int64_t tile = std::max<int64_t>(n_tile, step) / step * step;
    const int64_t ntiles = (full + tile - 1) / tile;
    parallel_for(ntiles, threads, [&](int64_t t) {
        const int64_t c1 = std::min(full, (t + 1) * tile);
        for (int64_t c = t * tile; c < c1; c += step) {
            if (nv == 8) w4_bf16_rows<SS, 8, SPLIT>(m, hi, lo, pstride, xsum, ngroups, qw, n, c, sc, zeros, zdef, gsize, y);
            else w4_bf16_rows<SS, 2, SPLIT>(m, hi, lo, pstride, xsum, ngroups, qw, n, c, sc, zeros, zdef, gsize, y);
        }
    });
    for (int64_t c = full; c + 16 <= n; c += 16)
        w4_bf16_rows<SS, 1, SPLIT>(m, hi, lo, pstride, xsum, ngroups, qw, n, c, sc, zeros, zdef, gsize, y);
}

// Returns false when this path does not apply (no AVX512_BF16, or float32 activations): nothing written.
template <class SS>
bool w4a16_bf16(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, int64_t n, const uint32_t *qw,
                const typename SS::T *scales, const uint8_t *zeros, int32_t zdef, int64_t gsize, float *y,
                int64_t n_tile, int32_t threads, std::vector<float> &x32, std::vector<float> &xsum) {
    if (xdt == HAL_F32 || !cpu_has_avx512_bf16()) return false;
    const bool split = xdt == HAL_F16;
    const int64_t ngroups = k / gsize, pstride = k / 2;  // 4 pair words per packed row
    // Bounded by the activations: one or two pair words per two activations.
    std::vector<uint32_t> hi(size_t(m) * pstride), lo(split ? size_t(m) * pstride : 0);
    parallel_for(m, threads, [&](int64_t r) {
        w4_bf16_pairs(x32.data() + r * k, k, split, hi.data() + r * pstride, split ? lo.data() + r * pstride : nullptr);
    });
    if (split)
        w4_bf16_columns<SS, true>(m, hi.data(), lo.data(), pstride, xsum.data(), ngroups, qw, n, scales, zeros,
                                  float(zdef), gsize, y, n_tile, threads);
    else
        w4_bf16_columns<SS, false>(m, hi.data(), nullptr, pstride, xsum.data(), ngroups, qw, n, scales, zeros,
                                   float(zdef), gsize, y, n_tile, threads);
    return true;
}
#endif
