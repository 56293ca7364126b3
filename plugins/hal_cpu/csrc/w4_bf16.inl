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

// acc[mb][v] + acl[mb][v] += the dot products of packed row r (codes w[v]) with row mb's activation pairs. The
// two chains take turns (and an fp16 value's low part goes to the other chain than its high part), so that twice
// as many dot products are in flight: a chain of one per nibble pair is latency-bound at small MB x NV.
template <int MB, int NV, bool SPLIT>
HAL_BF16_TARGET inline void w4_bf16_row(__m512 (&acc)[MB][NV], __m512 (&acl)[MB][NV], const __m512i (&w)[NV],
                                        const uint32_t *hi, const uint32_t *lo, int64_t pstride, int64_t r) {
#define HAL_W4_BF16_STEP(J, S, A, B)                                                                           \
    {                                                                                                        \
        __m512i b[NV];                                                                                       \
        for (int v = 0; v < NV; ++v) b[v] = w4_bf16_codes<S>(w[v]);                                          \
        for (int mb = 0; mb < MB; ++mb) {                                                                    \
            const __m512bh xh = (__m512bh)_mm512_set1_epi32(int(hi[mb * pstride + r * 4 + J]));              \
            for (int v = 0; v < NV; ++v) A[mb][v] = _mm512_dpbf16_ps(A[mb][v], (__m512bh)b[v], xh);         \
            if (SPLIT) {                                                                                     \
                const __m512bh xl = (__m512bh)_mm512_set1_epi32(int(lo[mb * pstride + r * 4 + J]));          \
                for (int v = 0; v < NV; ++v) B[mb][v] = _mm512_dpbf16_ps(B[mb][v], (__m512bh)b[v], xl);     \
            }                                                                                                \
        }                                                                                                    \
    }
    HAL_W4_BF16_STEP(0, 3, acc, acl)
    HAL_W4_BF16_STEP(1, -1, acl, acc)
    HAL_W4_BF16_STEP(2, -5, acc, acl)
    HAL_W4_BF16_STEP(3, -9, acl, acc)
#undef HAL_W4_BF16_STEP
}

// base + s (16 acc - (16 + z) sum x): group g's contribution to 16 columns from col = g * n + column.
template <class SS>
HAL_BF16_TARGET inline __m512 w4_bf16_fold(__m512 acc, __m512 base, const typename SS::T *scales,
                                           const uint8_t *zeros, float zdef, int64_t col, float xsum) {
    const __m512 s = vload<SS>(scales + col);
    const __m512 z16 = _mm512_add_ps(zeros ? V::load_u8(zeros + col) : _mm512_set1_ps(zdef), _mm512_set1_ps(16.0f));
    const __m512 t = _mm512_fnmadd_ps(z16, _mm512_set1_ps(xsum), _mm512_mul_ps(_mm512_set1_ps(16.0f), acc));
    return _mm512_fmadd_ps(s, t, base);
}

// Columns [n0, n0 + 16 NV) of MB rows over groups [g0, g1), each column walking those packed rows: totals stay
// in registers, starting from y's (add) or from zero.
template <class SS, int MB, int NV, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_tile(const uint32_t *hi, const uint32_t *lo, int64_t pstride, const float *xsum,
                                  int64_t ngroups, const uint32_t *qw, int64_t n, int64_t n0,
                                  const typename SS::T *scales, const uint8_t *zeros, float zdef, int64_t gsize,
                                  int64_t g0, int64_t g1, bool add, float *y, int64_t ldy) {
    const int64_t words = gsize / 8;
    __m512 tot[MB][NV];
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v)
            tot[mb][v] = add ? _mm512_loadu_ps(y + mb * ldy + n0 + v * 16) : _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
        __m512 acc[MB][NV], acl[MB][NV];
        for (int mb = 0; mb < MB; ++mb)
            for (int v = 0; v < NV; ++v) acc[mb][v] = acl[mb][v] = _mm512_setzero_ps();
        for (int64_t r = g * words; r < (g + 1) * words; ++r) {
            const uint32_t *wrow = qw + r * n + n0;
            __m512i w[NV];
            for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wrow + v * 16);
            w4_bf16_row<MB, NV, SPLIT>(acc, acl, w, hi, lo, pstride, r);
        }
        for (int v = 0; v < NV; ++v)
            for (int mb = 0; mb < MB; ++mb)
                tot[mb][v] = w4_bf16_fold<SS>(_mm512_add_ps(acc[mb][v], acl[mb][v]), tot[mb][v], scales, zeros, zdef,
                                              g * n + n0 + v * 16, xsum[mb * ngroups + g]);
    }
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + mb * ldy + n0 + v * 16, tot[mb][v]);
}

// Columns [c0, c1) of MB rows (c1 - c0 a multiple of 16 NV) over groups [g0, g1), swept pass by pass: `pass`
// packed rows at a time cross the whole range, so the weight is read as a few long sequential runs (one per
// packed row of the pass) that the prefetchers stream, not as many short runs a row apart. A group's partial
// sums wait between passes in part[MB][c1 - c0]; out (row stride n) receives the totals.
template <class SS, int MB, int NV, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_sweep(const uint32_t *hi, const uint32_t *lo, int64_t pstride, const float *xsum,
                                   int64_t ngroups, const uint32_t *qw, int64_t n, int64_t c0, int64_t c1,
                                   const typename SS::T *scales, const uint8_t *zeros, float zdef, int64_t gsize,
                                   int64_t g0, int64_t g1, int64_t pass, float *out, float *part) {
    const int64_t words = gsize / 8, width = c1 - c0, rows = g1 * words;
    for (int mb = 0; mb < MB; ++mb) std::fill(out + mb * n + c0, out + mb * n + c1, 0.0f);
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t r_begin = g * words, r_end = r_begin + words;
        for (int64_t r0 = r_begin; r0 < r_end; r0 += pass) {
            const int64_t r1 = std::min(r_end, r0 + pass);
            const bool first = r0 == r_begin, last = r1 == r_end;
            for (int64_t c = c0; c < c1; c += 16 * NV) {
                float *pc = part + (c - c0);
                __m512 acc[MB][NV], acl[MB][NV];
                for (int mb = 0; mb < MB; ++mb)
                    for (int v = 0; v < NV; ++v) {
                        acc[mb][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(pc + mb * width + v * 16);
                        acl[mb][v] = _mm512_setzero_ps();
                    }
                for (int64_t r = r0; r < r1; ++r) {
                    const uint32_t *wrow = qw + r * n + c;
                    const uint32_t *pf = w4_sweep_prefetch(qw, n, rows, r1 - r0, r, c, c0, c1);
                    for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char *>(pf + v * 16), _MM_HINT_T1);
                    __m512i w[NV];
                    for (int v = 0; v < NV; ++v) {
                        w[v] = _mm512_loadu_si512(wrow + v * 16);
                        // One load per vector, kept in a register: left to itself the compiler folds the load
                        // into each of the 4 shifts, and 4 load uops per cache line waiting on one miss fill
                        // the load queue, so fewer lines are in flight.
                        asm("" : "+v"(w[v]));
                    }
                    w4_bf16_row<MB, NV, SPLIT>(acc, acl, w, hi, lo, pstride, r);
                }
                for (int mb = 0; mb < MB; ++mb)
                    for (int v = 0; v < NV; ++v) {
                        acc[mb][v] = _mm512_add_ps(acc[mb][v], acl[mb][v]);
                        if (!last) {
                            _mm512_storeu_ps(pc + mb * width + v * 16, acc[mb][v]);
                            continue;
                        }
                        float *yc = out + mb * n + c + v * 16;
                        _mm512_storeu_ps(yc, w4_bf16_fold<SS>(acc[mb][v], _mm512_loadu_ps(yc), scales, zeros, zdef,
                                                              g * n + c + v * 16, xsum[mb * ngroups + g]));
                    }
            }
        }
    }
}

// Rows [0, m) x columns [c0, c1) over groups [g0, g1), one row tile at a time across the columns, so the tile's
// activations stay in L1 while the weights stream past them.
template <class SS, int NV, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_rows(int64_t m, const uint32_t *hi, const uint32_t *lo, int64_t pstride,
                                  const float *xsum, int64_t ngroups, const uint32_t *qw, int64_t n, int64_t c0,
                                  int64_t c1, const typename SS::T *sc, const uint8_t *zeros, float zdef,
                                  int64_t gsize, int64_t g0, int64_t g1, bool add, float *y) {
    // Accumulators (two chains each) within the 32 zmm registers: 6 rows with bf16 activations; with fp16 (SPLIT,
    // twice the broadcasts) 6 rows spill and run at half speed, 4 do not.
    constexpr int MB = NV >= 4 ? 1 : SPLIT ? 4 : 6;
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r;
        const int64_t rows = left >= MB ? MB : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int64_t c = c0; c < c1; c += 16 * NV) {
#define HAL_W4_BF16_ROWS(R)                                                                                      \
    w4_bf16_tile<SS, R, NV, SPLIT>(hi + r * pstride, SPLIT ? lo + r * pstride : nullptr, pstride,                \
                                   xsum + r * ngroups, ngroups, qw, n, c, sc, zeros, zdef, gsize, g0, g1, add,   \
                                   y + r * n, n)
            if (rows == MB) HAL_W4_BF16_ROWS(MB);
            else if (rows == 4) HAL_W4_BF16_ROWS(MB >= 4 ? 4 : 1);
            else if (rows == 2) HAL_W4_BF16_ROWS(MB >= 2 ? 2 : 1);
            else HAL_W4_BF16_ROWS(1);
#undef HAL_W4_BF16_ROWS
        }
        r += rows;
    }
}

template <class SS, bool SPLIT>
HAL_BF16_TARGET void w4_bf16_columns(int64_t m, const uint32_t *hi, const uint32_t *lo, int64_t pstride,
                                     const float *xsum, int64_t ngroups, const uint32_t *qw, int64_t n,
                                     const typename SS::T *sc, const uint8_t *zeros, float zdef, int64_t gsize,
                                     float *y, int64_t n_tile, int32_t k_parts, int32_t threads) {
    const bool sweep = m <= kW4SweepMaxM;
    const int64_t nv = sweep ? 4 : 2;
    const int64_t step = nv * 16;
    const int64_t full = n / step * step;
    const int64_t tile = std::max<int64_t>(n_tile, step) / step * step;
    if (sweep) {
        w4_sweep_parts(k_parts, ngroups, m, n, full, tile, y, threads,
                       [&](int64_t g0, int64_t g1, int64_t pass, int64_t c0, int64_t c1, float *out, float *part) {
            if (m == 2)
                w4_bf16_sweep<SS, 2, 4, SPLIT>(hi, lo, pstride, xsum, ngroups, qw, n, c0, c1, sc, zeros, zdef, gsize,
                                               g0, g1, pass, out, part);
            else
                w4_bf16_sweep<SS, 1, 4, SPLIT>(hi, lo, pstride, xsum, ngroups, qw, n, c0, c1, sc, zeros, zdef, gsize,
                                               g0, g1, pass, out, part);
        });
    } else {
        // K in chunks of about kW4ChunkRows packed rows: a row tile's activations for a chunk fit L1.
        const int64_t gchunk = std::max<int64_t>(1, kW4ChunkRows / (gsize / 8));
        parallel_for((full + tile - 1) / tile, threads, [&](int64_t t) {
            const int64_t c0 = t * tile, c1 = std::min(full, c0 + tile);
            for (int64_t g0 = 0; g0 < ngroups; g0 += gchunk)
                w4_bf16_rows<SS, 2, SPLIT>(m, hi, lo, pstride, xsum, ngroups, qw, n, c0, c1, sc, zeros, zdef, gsize,
                                           g0, std::min(ngroups, g0 + gchunk), g0 > 0, y);
        });
    }
    const int64_t tail = (n - full) / 16 * 16;
    w4_bf16_rows<SS, 1, SPLIT>(m, hi, lo, pstride, xsum, ngroups, qw, n, full, full + tail, sc, zeros, zdef, gsize,
                               0, ngroups, false, y);
}

// Returns false when this path does not apply (no AVX512_BF16, or float32 activations): nothing written.
template <class SS>
bool w4a16_bf16(const hal_cpu_w4a16_gemv_args &a, std::vector<float> &x32, std::vector<float> &xsum) {
    if (a.x_dtype == HAL_F32 || !cpu_has_avx512_bf16()) return false;
    const int32_t xdt = a.x_dtype, zdef = a.default_zero, k_parts = a.k_parts, threads = a.threads;
    const int64_t m = a.m, k = a.k, n = a.n, gsize = a.group_size, n_tile = a.n_tile;
    const uint32_t *qw = a.qweight;
    const uint8_t *zeros = a.zeros;
    float *y = a.y;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const bool split = xdt == HAL_F16;
    const int64_t ngroups = k / gsize, pstride = k / 2;  // 4 pair words per packed row
    // Bounded by the activations: one or two pair words per two activations.
    std::vector<uint32_t> hi(size_t(m) * pstride), lo(split ? size_t(m) * pstride : 0);
    parallel_for(m, threads, [&](int64_t r) {
        w4_bf16_pairs(x32.data() + r * k, k, split, hi.data() + r * pstride, split ? lo.data() + r * pstride : nullptr);
    });
    if (split)
        w4_bf16_columns<SS, true>(m, hi.data(), lo.data(), pstride, xsum.data(), ngroups, qw, n, scales, zeros,
                                  float(zdef), gsize, y, n_tile, k_parts, threads);
    else
        w4_bf16_columns<SS, false>(m, hi.data(), nullptr, pstride, xsum.data(), ngroups, qw, n, scales, zeros,
                                   float(zdef), gsize, y, n_tile, k_parts, threads);
    return true;
}
#endif
