// w4a8.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A8: int4 codes times activations quantised per token to int8, summed exactly in int32
// ---------------------------------------------------------------------------------------------
//
// Each row of x is quantised once per call, bit for bit as hal_core.quant.quantize_activations
// (float32: s = max(amax / 127, smallest subnormal), 1 for a zero row; q = rint(x / s) half to even,
// clipped to [-127, 127]). Within a group of K rows the products of q and the unsigned codes are
// summed in int32, and so is q itself: |sum(q * code) - z * sum(q)| <= 127 * G * (15 + 255) < 2**31
// for G <= 32768 (the wrapper's bound), so the group's integer d = sum(q * code) - z * sum(q) is exact.
// Then, group after group in order, y = fma(scale, float(d), y) from y = 0, and y *= s last. Every
// variant and thread count performs exactly these operations, so all give the same bits.
//
// A code word packs rows 8r .. 8r + 7 of one column, row 8r + t in nibble t. Its bytes masked with 0x0F
// hold the even rows (byte b: row 2b), shifted right by 4 first the odd rows (byte b: row 2b + 1), so
// each 8-row step of q is stored as (q0, q2, q4, q6, q1, q3, q5, q7): four bytes of q against the low
// nibbles, four against the high ones, without moving any code byte.
//   avx512vnni: vpdpbusd (4 unsigned code bytes x 4 signed q bytes summed into an int32 lane) over
//     register tiles of up to kW4a8TileRows rows x 64 columns (16 words of a code row per vector), one
//     group at a time; up to kW4a8VnniSweepRows rows are swept across each thread's whole column range
//     instead (w4a8_vnni_sweep); columns past the last full vector of 16 run the plain loop below.
//   avx2 and avx512 (without VNNI): vpmaddubsw byte-pair products summed in int16 over four code rows, then
//     vpmaddwd into int32 (w4a8_avx2.inl), 4 rows x 16 columns per register tile; up to 8 rows are swept
//     across each thread's whole column range instead (w4a8_avx2_sweep), the same integers and fold.
//   baseline: the same integer sums in plain C++ (the compiler vectorises the column loop).
// Tasks own kW4a8Cols columns of every row (avx512vnni: kW4a8WideCols where N gives every thread two tasks or
// more, so each code row is read as one 1 KiB run, and the next group's codes are prefetched): one group of
// their codes (G / 8 rows of 256 bytes per 64 columns) is read once per row tile from L1.

constexpr int64_t kW4a8Cols = 64;
constexpr int64_t kW4a8WideCols = 256;
constexpr int kW4a8TileRows = 4;

struct W4a8Panel {
    std::vector<int8_t> q;     // [rows, k], each 8-row step in the order (q0, q2, q4, q6, q1, q3, q5, q7); rows >= m
                               // (the tile path pads to whole row tiles), those past m zero
    std::vector<int32_t> sum;  // [m, groups] sum of q over each group
    std::vector<float> sx;     // [m] the token scale; NaN for a row holding NaN or Inf (q and sums stay 0)
    std::vector<int8_t> tiles; // the tile path's copy of q: [rows / 16][k / 64][16][64], one AMX tile per 1 KiB
};

// Row r of x quantised into the panel (dst: its k bytes in the panel's order, sums: its groups); row: k + 16
// floats of scratch. Returns the token scale, NaN for a row holding NaN or Inf (its bytes and sums stay 0).
inline float w4a8_quantise_row(const hal_cpu_w4a8_gemm_args &a, int64_t r, float *row, int8_t *dst, int32_t *sums) {
    const int64_t k = a.k, group = a.group_size;
    any_row_to_f32(row_ptr(a.x, a.x_dtype, r, a.x_stride), a.x_dtype, k, row);
    float amax = 0.0f;
    bool finite = true;
    int64_t i = 0;
#if defined(HAL_ISA_AVX512)
    V::f vmax = V::zero();
    __mmask16 nonfinite = 0;
    for (; i + 16 <= k; i += 16) {
        const V::f v = V::load(row + i);
        nonfinite |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN, SNaN, +Inf, -Inf
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    amax = _mm512_reduce_max_ps(vmax);
    finite = nonfinite == 0;
#endif
    for (; i < k; ++i) {
        finite &= std::isfinite(row[i]);
        amax = std::max(amax, std::fabs(row[i]));
    }
    if (!finite) return kNaN;
    const float s = amax > 0.0f ? std::max(amax / 127.0f, std::numeric_limits<float>::denorm_min()) : 1.0f;
    i = 0;
#if defined(HAL_ISA_AVX512)
    // The same float32 division and round-half-to-even as the scalar loop, 16 values at a time, each
    // 8-value step stored in the panel's order (0, 2, 4, 6, 1, 3, 5, 7).
    const __m512i order = _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0);
    const V::f vs = V::set1(s), lo = V::set1(-127.0f), hi = V::set1(127.0f);
    for (; i + 16 <= k; i += 16) {
        V::f v = _mm512_roundscale_ps(_mm512_div_ps(V::load(row + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
        const __m512i q = _mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(v));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i), _mm512_cvtepi32_epi8(q));
    }
#endif
    for (; i < k; ++i) {
        const int64_t t = i & 7;
        dst[(i & ~int64_t(7)) + (t >> 1) + (t & 1) * 4] =
            int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(row[i] / s))));
    }
    for (int64_t g = 0; g < k / group; ++g) {  // the order within a group does not change its sum
        int32_t total = 0;
        for (int64_t j = g * group; j < (g + 1) * group; ++j) total += dst[j];
        sums[g] = total;
    }
    return s;
}

inline void w4a8_quantise(const hal_cpu_w4a8_gemm_args &a, W4a8Panel &p, int64_t panel_rows) {
    const int64_t m = a.m, k = a.k, groups = k / a.group_size;
    p.q.assign(size_t(panel_rows) * k, 0);
    p.sum.assign(size_t(m) * groups, 0);
    p.sx.assign(size_t(m), 0.0f);
    const int64_t per_task = 8, tasks = (m + per_task - 1) / per_task;
    TaskSlots slots(std::min<int64_t>(tasks, std::max<int32_t>(a.threads, 1)));
    const size_t width = size_t(k) + 16;
    std::vector<float> rows(size_t(slots.count()) * width);
    parallel_for(tasks, a.threads, [&](int64_t t) {
        const int64_t slot = slots.acquire();
        float *row = rows.data() + size_t(slot) * width;
        for (int64_t r = t * per_task; r < std::min(m, (t + 1) * per_task); ++r)
            p.sx[r] = w4a8_quantise_row(a, r, row, p.q.data() + r * k, p.sum.data() + r * groups);
        slots.release(slot);
    });
}

// Rows [r0, r1) x columns [c0, c1) (at most kW4a8Cols) over every group in order: y = fma(scale, float(d), y)
// from the zeros the task wrote.
template <class SS>
inline void w4a8_plain(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t r0, int64_t r1, int64_t c0,
                       int64_t c1) {
    const int64_t k = a.k, n = a.n, group = a.group_size, groups = k / group, width = c1 - c0;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    for (int64_t r = r0; r < r1; ++r) {
        float *yr = a.y + r * n + c0;
        const int8_t *xq = p.q.data() + r * k;
        for (int64_t g = 0; g < groups; ++g) {
            int32_t acc[kW4a8Cols] = {};
            for (int64_t w = g * group / 8; w < (g + 1) * group / 8; ++w) {
                const uint32_t *codes = a.qweight + w * n + c0;
                const int8_t *q = xq + 8 * w;
                for (int64_t c = 0; c < width; ++c) {
                    const uint32_t v = codes[c];
                    int32_t t = 0;
                    for (int b = 0; b < 4; ++b)
                        t += int32_t(q[b]) * int32_t((v >> (8 * b)) & 15u) +
                             int32_t(q[4 + b]) * int32_t((v >> (8 * b + 4)) & 15u);
                    acc[c] += t;
                }
            }
            const int32_t qs = p.sum[r * groups + g];
            for (int64_t c = 0; c < width; ++c) {
                const int64_t col = g * n + c0 + c;
                const int32_t z = a.zeros ? int32_t(a.zeros[col]) : a.default_zero;
                yr[c] = std::fma(SS::scalar(scales + col), float(acc[c] - z * qs), yr[c]);
            }
        }
    }
}

#if defined(HAL_ISA_VNNI)
// Rows [r0, r0 + MR) x columns [c0, c0 + 16 NV) of group g: y = fma(scale, float(d), y).
template <class SS, int MR, int NV>
inline void w4a8_tile(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t g, int64_t r0, int64_t c0) {
    const int64_t k = a.k, n = a.n, group = a.group_size, groups = k / group;
    VI::i acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = VI::zero();
    const VI::i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    const int8_t *xq = p.q.data() + r0 * k;
    for (int64_t w = g * group / 8; w < (g + 1) * group / 8; ++w) {
        const uint32_t *codes = a.qweight + w * n + c0;
        for (int v = 0; v < NV; ++v) {
            const VI::i word = _mm512_loadu_si512(codes + 16 * v);
            const VI::i lo = _mm512_and_si512(word, nibbles);
            const VI::i hi = _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles);
            for (int r = 0; r < MR; ++r) {
                acc[r][v] = VI::dot(acc[r][v], lo, VI::bcast4(xq + r * k + 8 * w));
                acc[r][v] = VI::dot(acc[r][v], hi, VI::bcast4(xq + r * k + 8 * w + 4));
            }
        }
    }
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    for (int v = 0; v < NV; ++v) {
        const int64_t col = g * n + c0 + 16 * v;
        const V::f s = vload<SS>(scales + col);
        const auto *zp = reinterpret_cast<const __m128i *>(a.zeros + col);
        const VI::i z = a.zeros ? _mm512_cvtepu8_epi32(_mm_loadu_si128(zp)) : _mm512_set1_epi32(a.default_zero);
        for (int r = 0; r < MR; ++r) {
            const VI::i qs = _mm512_set1_epi32(p.sum[(r0 + r) * groups + g]);
            const VI::i d = _mm512_sub_epi32(acc[r][v], _mm512_mullo_epi32(z, qs));
            float *out = a.y + (r0 + r) * n + c0 + 16 * v;
            V::store(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), V::load(out)));
        }
    }
}

template <class SS, int MR>
inline void w4a8_tile_cols(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t g, int64_t r0, int64_t c0,
                           int64_t vectors) {
    switch (vectors) {
        case 4: w4a8_tile<SS, MR, 4>(a, p, g, r0, c0); break;
        case 3: w4a8_tile<SS, MR, 3>(a, p, g, r0, c0); break;
        case 2: w4a8_tile<SS, MR, 2>(a, p, g, r0, c0); break;
        default: w4a8_tile<SS, MR, 1>(a, p, g, r0, c0); break;
    }
}

// Every row x columns [c0, c0 + 16 vectors), group after group.
template <class SS>
inline void w4a8_vnni_block(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t vectors) {
    const int64_t m = a.m, groups = a.k / a.group_size, rows = a.group_size / 8;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t sub = 0; sub < vectors; sub += 4) {  // register tiles of up to 64 columns
        const int64_t cs = c0 + 16 * sub, vs = std::min<int64_t>(4, vectors - sub);
        // The next group's codes of these columns: rows of 64 * vectors bytes, N words apart, which the
        // hardware prefetchers do not follow (a weight read from memory ran at a fifth of the copy bandwidth).
        if (g + 1 < groups)
            for (int64_t w = (g + 1) * rows; w < (g + 2) * rows; ++w)
                for (int64_t v = 0; v < vectors; ++v)
                    _mm_prefetch(reinterpret_cast<const char *>(a.qweight + w * a.n + c0 + 16 * v), _MM_HINT_T0);
        int64_t r = 0;
        for (; r + kW4a8TileRows <= m; r += kW4a8TileRows)
            w4a8_tile_cols<SS, kW4a8TileRows>(a, p, g, r, cs, vs);
        switch (m - r) {
            case 3: w4a8_tile_cols<SS, 3>(a, p, g, r, cs, vs); break;
            case 2: w4a8_tile_cols<SS, 2>(a, p, g, r, cs, vs); break;
            case 1: w4a8_tile_cols<SS, 1>(a, p, g, r, cs, vs); break;
            default: break;
        }
      }
    }
}

//: Rows of x up to which the VNNI kernel sweeps each thread's column range (w4a8_vnni_sweep) instead of the tiles
//: (measured on a Zen 4 VM: 1.7-2.2x the tiles at one row, 1.4-1.9x at two, level to 1.4x at eight).
constexpr int64_t kW4a8VnniSweepRows = 8;
//: Code rows swept together across the range (their int32 sums stay in registers between them).
constexpr int64_t kW4a8VnniWords = 8;

// Rows [0, R) of x against columns [c0, c1) (a multiple of 16), the task's whole range: each group's code rows are
// swept kW4a8VnniWords at a time across the range, so every code row is read once, as one long run (the tiles read
// 1 KiB runs a code row apart: a new page per code row, whose TLB misses cost more than the arithmetic at one row),
// and the group's int32 sums wait in part[R][c1 - c0] between sweeps. The integers and the fold are the tiles': the
// same bits.
template <class SS, int R>
inline void w4a8_vnni_sweep(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t c1,
                            int32_t *part) {
    const int64_t k = a.k, n = a.n, group = a.group_size, groups = k / group, width = c1 - c0;
    const VI::i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const int8_t *xq = p.q.data();
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t w_begin = g * group / 8, w_end = (g + 1) * group / 8;
        for (int64_t w0 = w_begin; w0 < w_end; w0 += kW4a8VnniWords) {
            const int64_t words = std::min<int64_t>(kW4a8VnniWords, w_end - w0);
            const bool first = w0 == w_begin;
            const uint32_t *rows = a.qweight + w0 * n;
            for (int64_t c = c0; c < c1; c += 16) {
                VI::i acc[R];
                for (int r = 0; r < R; ++r)
                    acc[r] = first ? VI::zero() : _mm512_loadu_si512(part + r * width + (c - c0));
                for (int64_t i = 0; i < words; ++i) {
                    const VI::i word = _mm512_loadu_si512(rows + i * n + c);
                    const VI::i lo = _mm512_and_si512(word, nibbles);
                    const VI::i hi = _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles);
                    for (int r = 0; r < R; ++r) {
                        acc[r] = VI::dot(acc[r], lo, VI::bcast4(xq + r * k + 8 * (w0 + i)));
                        acc[r] = VI::dot(acc[r], hi, VI::bcast4(xq + r * k + 8 * (w0 + i) + 4));
                    }
                }
                for (int r = 0; r < R; ++r) _mm512_storeu_si512(part + r * width + (c - c0), acc[r]);
            }
        }
        for (int64_t c = c0; c < c1; c += 16) {
            const int64_t col = g * n + c;
            const V::f s = vload<SS>(scales + col);
            const auto *zp = reinterpret_cast<const __m128i *>(a.zeros + col);
            const VI::i z = a.zeros ? _mm512_cvtepu8_epi32(_mm_loadu_si128(zp)) : _mm512_set1_epi32(a.default_zero);
            for (int r = 0; r < R; ++r) {
                const VI::i qs = _mm512_set1_epi32(p.sum[r * groups + g]);
                const VI::i d = _mm512_sub_epi32(_mm512_loadu_si512(part + r * width + (c - c0)),
                                                 _mm512_mullo_epi32(z, qs));
                float *out = a.y + r * n + c;
                V::store(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), V::load(out)));
            }
        }
    }
}

// Every row of a call of at most kW4a8VnniSweepRows rows against columns [c0, c1) (a multiple of 16).
template <class SS>
inline void w4a8_sweep_rows(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t c1,
                            int32_t *part) {
    switch (a.m) {
        case 1: w4a8_vnni_sweep<SS, 1>(a, p, c0, c1, part); break;
        case 2: w4a8_vnni_sweep<SS, 2>(a, p, c0, c1, part); break;
        case 3: w4a8_vnni_sweep<SS, 3>(a, p, c0, c1, part); break;
        case 4: w4a8_vnni_sweep<SS, 4>(a, p, c0, c1, part); break;
        case 5: w4a8_vnni_sweep<SS, 5>(a, p, c0, c1, part); break;
        case 6: w4a8_vnni_sweep<SS, 6>(a, p, c0, c1, part); break;
        case 7: w4a8_vnni_sweep<SS, 7>(a, p, c0, c1, part); break;
        default: w4a8_vnni_sweep<SS, 8>(a, p, c0, c1, part); break;
    }
}
constexpr int64_t kW4a8SweepRows = kW4a8VnniSweepRows;
constexpr int64_t kW4a8SweepLanes = 16;
#define HAL_W4A8_SWEEP 1
#include "w4a8_amx.inl"
constexpr bool kW4a8VnniTiles = true;
#else
constexpr bool kW4a8VnniTiles = false;  // the plain loop takes at most kW4a8Cols columns
constexpr int64_t kW4a8AmxCols = kW4a8Cols;
inline bool w4a8_amx_applies(const hal_cpu_w4a8_gemm_args &) { return false; }
#endif
#if defined(HAL_INT8_AVX2)  // w8a8.inl
#define HAL_W4A8_AVX2 1
#include "w4a8_avx2.inl"
template <class SS>
inline void w4a8_sweep_rows(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t c1,
                            int32_t *part) {
    w4a8_avx2_sweep_rows<SS>(a, p, c0, c1, part);
}
constexpr int64_t kW4a8SweepRows = kW4a8Avx2SweepRows;
constexpr int64_t kW4a8SweepLanes = 8;
#define HAL_W4A8_SWEEP 1
#endif

// Whether W4A8 and W8A8 with many rows run on AMX-INT8 tiles here (hal_cpu_gemm_amx; each has its own conditions).
#if defined(HAL_ISA_VNNI)
inline int gemm_amx_enabled() { return hal_cpu_attention_amx_allowed() && amx_int8_usable() ? 1 : 0; }
#else
inline int gemm_amx_enabled() { return 0; }
#endif

template <class SS>
int w4a8_t(const hal_cpu_w4a8_gemm_args &a) {
    const int64_t m = a.m, n = a.n;
    W4a8Panel p;
    const bool amx = w4a8_amx_applies(a);
    w4a8_quantise(a, p, amx ? (m + 31) / 32 * 32 : m);
#if defined(HAL_ISA_VNNI)
    if (amx) w4a8_amx_tile_panel(a, p);
#endif
    std::atomic<bool> failed{false};
#if defined(HAL_W4A8_SWEEP)
    if (!amx && m <= kW4a8SweepRows) {  // one contiguous range of columns (whole vectors) per thread, swept
        constexpr int64_t lanes = kW4a8SweepLanes;
        const int64_t vecs = n / lanes;
        const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(std::max<int32_t>(a.threads, 1), vecs));
        parallel_for(tasks, a.threads, [&](int64_t t) {
            const int64_t c0 = vecs * t / tasks * lanes, c1 = vecs * (t + 1) / tasks * lanes;
            for (int64_t r = 0; r < m; ++r) std::fill(a.y + r * n + c0, a.y + r * n + c1, 0.0f);
            if (c1 == c0) return;
            int32_t *part = new (std::nothrow) int32_t[size_t(m * (c1 - c0))];
            if (!part) {
                failed = true;
                return;
            }
            w4a8_sweep_rows<SS>(a, p, c0, c1, part);
            delete[] part;
        });
        if (failed) return HAL_ENOMEM;
        if (vecs * lanes < n) {
            for (int64_t r = 0; r < m; ++r) std::fill(a.y + r * n + vecs * lanes, a.y + (r + 1) * n, 0.0f);
            w4a8_plain<SS>(a, p, 0, m, vecs * lanes, n);
        }
        for (int64_t r = 0; r < m; ++r) {
            const float s = p.sx[r];
            for (int64_t i = 0; i < n; ++i) a.y[r * n + i] *= s;
        }
        return HAL_OK;
    }
#endif
    // Wide tasks read each code row as one run of 1 KiB (what the prefetchers follow), where there are enough.
    const bool wide = kW4a8VnniTiles && n >= 2 * std::max<int32_t>(a.threads, 1) * kW4a8WideCols;
    const int64_t cols = amx ? kW4a8AmxCols : wide ? kW4a8WideCols : kW4a8Cols;
    const int64_t blocks = (n + cols - 1) / cols;
    parallel_for(blocks, a.threads, [&](int64_t b) {
        const int64_t c0 = b * cols, c1 = std::min(n, c0 + cols);
        for (int64_t r = 0; r < m; ++r) std::fill(a.y + r * n + c0, a.y + r * n + c1, 0.0f);
        int64_t done = c0;
#if defined(HAL_ISA_VNNI)
        if (amx && c1 - c0 >= 32) {
            // The task's unpacked codes (w4a8_amx.inl): about 64 KiB, freed when the task ends.
            const int64_t tiles = (c1 - c0) / 32 * 2;
            uint8_t *strip = new (std::nothrow) uint8_t[size_t(w4a8_amx_chunk(a.group_size)) * 16 * tiles];
            if (!strip) {
                failed = true;
                return;
            }
            w4a8_amx_block<SS>(a, p, c0, tiles, strip);
            delete[] strip;
            done = c0 + 16 * tiles;
        }
        const int64_t vectors = (c1 - done) / 16;
        if (vectors) w4a8_vnni_block<SS>(a, p, done, vectors);
        done += 16 * vectors;
#elif defined(HAL_W4A8_AVX2)
        const int64_t vectors = (c1 - done) / 8;
        if (vectors) w4a8_avx2_block<SS>(a, p, done, vectors);
        done += 8 * vectors;
#endif
        if (done < c1) w4a8_plain<SS>(a, p, 0, m, done, c1);
    });
    if (failed) return HAL_ENOMEM;
    parallel_for(m, a.threads, [&](int64_t r) {
        float *yr = a.y + r * n;
        const float s = p.sx[r];
        for (int64_t i = 0; i < n; ++i) yr[i] *= s;
    });
    return HAL_OK;
}

int w4a8_gemm(const hal_cpu_w4a8_gemm_args *args) {
    try {
        const hal_cpu_w4a8_gemm_args &a = *args;
        if (a.s_dtype == HAL_F16) return w4a8_t<F16>(a);
        if (a.s_dtype == HAL_BF16) return w4a8_t<BF16>(a);
        return w4a8_t<F32>(a);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
