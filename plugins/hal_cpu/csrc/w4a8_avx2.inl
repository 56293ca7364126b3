// w4a8_avx2.inl: included by w4a8.inl in the avx2 and avx512 variants (256-bit code only: the avx512 variant
// runs on CPUs without VNNI, where these are its byte products); not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A8 on AVX2: byte products in vpmaddubsw, summed in int16 over four code rows, then in int32
// ---------------------------------------------------------------------------------------------
//
// The same integer sums as the plain loop and the avx512vnni tiles, 8 columns (one code word each) per
// vector. vpmaddubsw multiplies the unsigned code bytes by the signed activation bytes and adds adjacent
// pairs into int16: |sum| <= 2 * 15 * 127 = 3810, never saturated. The low and high nibbles of a word
// (k rows 0, 2, 4, 6 and 1, 3, 5, 7 of its 8-row step, the panel's byte order) give two such vectors; the
// int16 partials of up to kW4a8Avx2Words code rows are added (|sum| <= 4 * 7620 = 30480 < 2**15, exact) before
// vpmaddwd widens them to int32. Every group's d = sum(q * code) - z * sum(q) is therefore the exact integer the
// other variants compute, and y = fma(scale, float(d), y) the same float operation: all give the same bits.

//: Code rows whose int16 partial sums are added before widening (4 * 2 * 2 * 15 * 127 < 2**15).
constexpr int64_t kW4a8Avx2Words = 4;
//: Rows of x per register tile, and vectors of 8 columns: 4 x 2 int32 accumulators, 4 x 2 int16 partials.
constexpr int kW4a8Avx2Rows = 4;
constexpr int kW4a8Avx2Vectors = 2;

// Rows [r0, r0 + MR) x columns [c0, c0 + 8 NV) of group g: y = fma(scale, float(d), y).
template <class SS, int MR, int NV>
inline void w4a8_avx2_tile(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t g, int64_t r0, int64_t c0) {
    const int64_t k = a.k, n = a.n, group = a.group_size, groups = k / group;
    const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
    __m256i acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
    const int8_t *xq = p.q.data() + r0 * k;
    const int64_t w_begin = g * group / 8, w_end = (g + 1) * group / 8;
    for (int64_t w0 = w_begin; w0 < w_end; w0 += kW4a8Avx2Words) {
        __m256i part[MR][NV];
        for (int r = 0; r < MR; ++r)
            for (int v = 0; v < NV; ++v) part[r][v] = _mm256_setzero_si256();
        for (int64_t w = w0; w < std::min(w_end, w0 + kW4a8Avx2Words); ++w) {
            const uint32_t *codes = a.qweight + w * n + c0;
            __m256i lo[NV], hi[NV];
            for (int v = 0; v < NV; ++v) {
                const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes + 8 * v));
                lo[v] = _mm256_and_si256(word, nibbles);
                hi[v] = _mm256_and_si256(_mm256_srli_epi32(word, 4), nibbles);
            }
            for (int r = 0; r < MR; ++r) {
                int32_t even, odd;
                std::memcpy(&even, xq + r * k + 8 * w, 4);
                std::memcpy(&odd, xq + r * k + 8 * w + 4, 4);
                const __m256i xe = _mm256_set1_epi32(even), xo = _mm256_set1_epi32(odd);
                for (int v = 0; v < NV; ++v)
                    part[r][v] = _mm256_add_epi16(part[r][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xe),
                                                                               _mm256_maddubs_epi16(hi[v], xo)));
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(part[r][v], ones));
    }
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    for (int v = 0; v < NV; ++v) {
        const int64_t col = g * n + c0 + 8 * v;
        const __m256 s = avx2_scales<SS>(scales + col);
        const __m256i z = a.zeros ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(a.zeros + col)))
                                  : _mm256_set1_epi32(a.default_zero);
        for (int r = 0; r < MR; ++r) {
            const __m256i qs = _mm256_set1_epi32(p.sum[(r0 + r) * groups + g]);
            const __m256i d = _mm256_sub_epi32(acc[r][v], _mm256_mullo_epi32(z, qs));
            float *out = a.y + (r0 + r) * n + c0 + 8 * v;
            _mm256_storeu_ps(out, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), _mm256_loadu_ps(out)));
        }
    }
}

template <class SS, int MR>
inline void w4a8_avx2_cols(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t g, int64_t r0, int64_t c0,
                           int64_t vectors) {
    if (vectors >= 2) w4a8_avx2_tile<SS, MR, 2>(a, p, g, r0, c0);
    else w4a8_avx2_tile<SS, MR, 1>(a, p, g, r0, c0);
}

// Every row x columns [c0, c0 + 8 vectors), group after group, in register tiles of up to 4 rows x 16 columns.
template <class SS>
inline void w4a8_avx2_block(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t vectors) {
    const int64_t m = a.m, groups = a.k / a.group_size;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t sub = 0; sub < vectors; sub += kW4a8Avx2Vectors) {
            const int64_t cs = c0 + 8 * sub, vs = std::min<int64_t>(kW4a8Avx2Vectors, vectors - sub);
            int64_t r = 0;
            for (; r + kW4a8Avx2Rows <= m; r += kW4a8Avx2Rows) w4a8_avx2_cols<SS, kW4a8Avx2Rows>(a, p, g, r, cs, vs);
            switch (m - r) {
                case 3: w4a8_avx2_cols<SS, 3>(a, p, g, r, cs, vs); break;
                case 2: w4a8_avx2_cols<SS, 2>(a, p, g, r, cs, vs); break;
                case 1: w4a8_avx2_cols<SS, 1>(a, p, g, r, cs, vs); break;
                default: break;
            }
        }
}

//: Rows of x up to which W4A8 sweeps each thread's column range (w4a8_avx2_sweep) instead of the register tiles.
constexpr int64_t kW4a8Avx2SweepRows = 8;

// Rows [0, R) of x (M = R <= kW4a8Avx2SweepRows) against columns [c0, c1) (a multiple of 8), the task's whole range:
// each group's code rows are swept kW4a8Avx2Words at a time across the range, so every code row is read once, as one
// long run (what the prefetchers follow: the register tiles above read 64-byte runs a code row apart, a fraction of
// the copy bandwidth at a few rows), and the group's int32 sums wait in part[R][c1 - c0] between sweeps. The integers
// and the fold are the tiles': the same bits.
template <class SS, int R>
inline void w4a8_avx2_sweep(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t c1,
                            int32_t *part) {
    const int64_t k = a.k, n = a.n, group = a.group_size, groups = k / group, width = c1 - c0;
    const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t w_begin = g * group / 8, w_end = (g + 1) * group / 8;
        for (int64_t w0 = w_begin; w0 < w_end; w0 += kW4a8Avx2Words) {
            const int64_t words = std::min<int64_t>(kW4a8Avx2Words, w_end - w0);
            int32_t even[R][kW4a8Avx2Words], odd[R][kW4a8Avx2Words];
            for (int r = 0; r < R; ++r)
                for (int64_t i = 0; i < words; ++i) {
                    std::memcpy(&even[r][i], p.q.data() + r * k + 8 * (w0 + i), 4);
                    std::memcpy(&odd[r][i], p.q.data() + r * k + 8 * (w0 + i) + 4, 4);
                }
            const bool first = w0 == w_begin;
            const uint32_t *rows = a.qweight + w0 * n;
            for (int64_t c = c0; c < c1; c += 8) {
                __m256i sum16[R];
                for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
                for (int64_t i = 0; i < words; ++i) {
                    const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(rows + i * n + c));
                    const __m256i lo = _mm256_and_si256(word, nibbles);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(word, 4), nibbles);
                    for (int r = 0; r < R; ++r)
                        sum16[r] = _mm256_add_epi16(
                            sum16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(even[r][i])),
                                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd[r][i]))));
                }
                for (int r = 0; r < R; ++r) {
                    __m256i sum32 = _mm256_madd_epi16(sum16[r], ones);
                    auto *pc = reinterpret_cast<__m256i *>(part + r * width + (c - c0));
                    if (!first) sum32 = _mm256_add_epi32(sum32, _mm256_loadu_si256(pc));
                    _mm256_storeu_si256(pc, sum32);
                }
            }
        }
        for (int64_t c = c0; c < c1; c += 8) {
            const int64_t col = g * n + c;
            const __m256 s = avx2_scales<SS>(scales + col);
            const __m256i z = a.zeros ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(a.zeros + col)))
                                      : _mm256_set1_epi32(a.default_zero);
            for (int r = 0; r < R; ++r) {
                const __m256i qs = _mm256_set1_epi32(p.sum[r * groups + g]);
                const __m256i acc = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(part + r * width + (c - c0)));
                const __m256i d = _mm256_sub_epi32(acc, _mm256_mullo_epi32(z, qs));
                float *out = a.y + r * n + c;
                _mm256_storeu_ps(out, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), _mm256_loadu_ps(out)));
            }
        }
    }
}

// Every row of a call of at most kW4a8Avx2SweepRows rows against columns [c0, c1) (a multiple of 8).
template <class SS>
inline void w4a8_avx2_sweep_rows(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t c1,
                                 int32_t *part) {
    switch (a.m) {
        case 1: w4a8_avx2_sweep<SS, 1>(a, p, c0, c1, part); break;
        case 2: w4a8_avx2_sweep<SS, 2>(a, p, c0, c1, part); break;
        case 3: w4a8_avx2_sweep<SS, 3>(a, p, c0, c1, part); break;
        case 4: w4a8_avx2_sweep<SS, 4>(a, p, c0, c1, part); break;
        case 5: w4a8_avx2_sweep<SS, 5>(a, p, c0, c1, part); break;
        case 6: w4a8_avx2_sweep<SS, 6>(a, p, c0, c1, part); break;
        case 7: w4a8_avx2_sweep<SS, 7>(a, p, c0, c1, part); break;
        default: w4a8_avx2_sweep<SS, 8>(a, p, c0, c1, part); break;
    }
}
