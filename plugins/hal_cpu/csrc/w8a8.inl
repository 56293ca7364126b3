// w8a8.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W8A8: per-token quantisation fused; exact integer sums per group
// ---------------------------------------------------------------------------------------------
//
// Codes and quantised activations are small integers, so their products and running sums are
// exact in fp32 while below 2**24: 127 * 255 * 512 < 2**24. Groups are therefore walked in
// segments of at most 512 rows; each segment's exact sum has its zero-point term subtracted
// (exact too) before the group scale is applied. The avx512vnni variant runs the integer kernels of
// w8a8_vnni.inl instead, the avx2 and avx512 variants (from 2 rows) those of w8a8_avx2.inl for whole
// vectors of 8 columns (the same segments and epilogue, so the same bits).

constexpr int64_t kExactRows = 512;

struct Segment { int64_t start, end; int32_t group; };

#if defined(HAL_ISA_AVX2) || (defined(HAL_ISA_AVX512) && !defined(HAL_ISA_VNNI))
#define HAL_INT8_AVX2 1  // integer W8A8 and W4A8 kernels of 256-bit vectors (w8a8_avx2.inl, w4a8_avx2.inl)
#include "w8a8_avx2.inl"
#endif

// Columns [n0, n0 + NV W) of MB rows over segments [s0, s1) (nseg in all, the stride of xqsum's rows).
template <class SS, int MB, int NV>
inline void w8_tile(const float *xq, int64_t k, const float *xqsum, int64_t nseg, int64_t s0, int64_t s1,
                    const Segment *segs, const int32_t *perm, const uint8_t *qw, int64_t n, int64_t n0,
                    const typename SS::T *scales, const uint8_t *zeros, float zdef, float *y, int64_t ldy) {
    V::f tot[MB][NV];
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) tot[mb][v] = V::zero();
    for (int64_t sgi = s0; sgi < s1; ++sgi) {
        const Segment sg = segs[sgi];
        V::f acc[MB][NV];
        for (int mb = 0; mb < MB; ++mb)
            for (int v = 0; v < NV; ++v) acc[mb][v] = V::zero();
        for (int64_t i = sg.start; i < sg.end; ++i) {
            const uint8_t *wrow = qw + (perm ? int64_t(perm[i]) : i) * n + n0;
            V::f wf[NV];
            for (int v = 0; v < NV; ++v) wf[v] = V::load_u8(wrow + v * W);
            for (int mb = 0; mb < MB; ++mb) {
                const V::f xb = V::set1(xq[mb * k + i]);
                for (int v = 0; v < NV; ++v) acc[mb][v] = V::fma(xb, wf[v], acc[mb][v]);
            }
        }
        for (int v = 0; v < NV; ++v) {
            const int64_t col = int64_t(sg.group) * n + n0 + v * W;
            const V::f s = vload<SS>(scales + col);
            const V::f z = zeros ? V::load_u8(zeros + col) : V::set1(zdef);
            for (int mb = 0; mb < MB; ++mb)
                tot[mb][v] = V::fma(s, V::fnma(z, V::set1(xqsum[mb * nseg + sgi]), acc[mb][v]), tot[mb][v]);
        }
    }
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) V::store(y + mb * ldy + n0 + v * W, tot[mb][v]);
}

template <class SS, int NV>
inline void w8_rows(int64_t rows, const float *xq, int64_t k, const float *xqsum, int64_t nseg, int64_t s0,
                    int64_t s1, const Segment *segs, const int32_t *perm, const uint8_t *qw, int64_t n, int64_t n0,
                    const typename SS::T *sc, const uint8_t *zeros, float zdef, float *y) {
    constexpr int MB = NV >= 4 ? 1 : (W >= 16 ? 6 : 2);
    for (int64_t r = 0; r < rows;) {
        const int64_t left = std::min<int64_t>(MB, rows - r);
#define HAL_W8_ROWS(R) w8_tile<SS, R, NV>(xq + r * k, k, xqsum + r * nseg, nseg, s0, s1, segs, perm, qw, n, n0, sc, \
                                          zeros, zdef, y + r * n, n)
        if (left >= MB) HAL_W8_ROWS(MB);
        else if (MB > 4 && left >= 4) { HAL_W8_ROWS(4 <= MB ? 4 : 1); r += 4; continue; }
        else if (left >= 2) { HAL_W8_ROWS(2 <= MB ? 2 : 1); r += 2; continue; }
        else HAL_W8_ROWS(1);
#undef HAL_W8_ROWS
        r += left >= MB ? MB : 1;
    }
}

// Each run of one group cut into segments of at most kExactRows rows.
inline std::vector<Segment> w8_segments(const int64_t *starts, const int32_t *group_of_run, int64_t runs) {
    std::vector<Segment> segs;
    for (int64_t r = 0; r < runs; ++r)
        for (int64_t s = starts[r]; s < starts[r + 1]; s += kExactRows)
            segs.push_back({s, std::min(starts[r + 1], s + kExactRows), group_of_run[r]});
    return segs;
}

template <class SS>
int w8a8_t(const hal_cpu_w8a8_gemm_args &a, const std::vector<Segment> &segs) {
    const void *x = a.x;
    const int32_t xdt = a.x_dtype, zdef = a.default_zero, k_parts = a.k_parts, threads = a.threads;
    const int64_t xstride = a.x_stride, m = a.m, k = a.k, n = a.n, n_tile = a.n_tile;
    const uint8_t *qw = a.qweight, *zeros = a.zeros;
    const int32_t *perm = a.perm;
    float *y = a.y;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const int64_t nseg = int64_t(segs.size());
    std::vector<float> xq(size_t(m) * k), xqsum(size_t(m) * std::max<int64_t>(nseg, 1)), sx(m);
    std::vector<char> bad(m, 0);
    parallel_for(m, threads, [&](int64_t r) {
        // The reference's quantize_activations, bit for bit: amax / 127 (at least the smallest
        // subnormal; 1 for a zero row), then rint(x / sx) clipped to [-127, 127].
        float *row = xq.data() + r * k;
        any_row_to_f32(row_ptr(x, xdt, r, xstride), xdt, k, row);
        float amax = 0.0f;
        bool finite = true;
        for (int64_t i = 0; i < k; ++i) {
            finite &= std::isfinite(row[i]);
            amax = std::max(amax, std::fabs(row[i]));
        }
        bad[r] = !finite;
        const float s = amax > 0.0f ? std::max(amax / 127.0f, std::numeric_limits<float>::denorm_min()) : 1.0f;
        sx[r] = s;
        std::vector<float> q(perm ? size_t(k) : 0);
        float *dst = perm ? q.data() : row;
        for (int64_t i = 0; i < k; ++i) dst[i] = std::min(127.0f, std::max(-127.0f, std::nearbyint(row[i] / s)));
        if (perm)
            for (int64_t i = 0; i < k; ++i) row[i] = q[perm[i]];
        for (int64_t sgi = 0; sgi < nseg; ++sgi) {
            float t = 0.0f;
            for (int64_t i = segs[sgi].start; i < segs[sgi].end; ++i) t += row[i];
            xqsum[r * nseg + sgi] = t;
        }
    });
    const bool gemv = m <= 2;
#if defined(HAL_INT8_AVX2)
    const bool pairs_kernel = m >= 2;  // one row: the float sums, swept across the task's columns (w8_avx2_sweep1)
    W8Pairs pairs;
    if (pairs_kernel) w8_avx2_pairs(xq.data(), xqsum.data(), m, k, segs, pairs, threads);
    const W8Avx2Job<SS> job{pairs, segs.data(), nseg, n, perm, qw, zeros, scales, zdef};
#endif
    const int64_t nv = gemv ? 4 : 2, step = nv * W;
    const int64_t tile = std::max<int64_t>(n_tile, step) / step * step;
    // Columns [c0, c1) (c0 a multiple of step) over segments [s0, s1), into out (row stride n).
    const auto columns = [&](int64_t c0, int64_t c1, int64_t s0, int64_t s1, float *out) {
#define HAL_W8_COLS(NV) \
    w8_rows<SS, NV>(m, xq.data(), k, xqsum.data(), nseg, s0, s1, segs.data(), perm, qw, n, c, scales, zeros, \
                    float(zdef), out)
        int64_t c = c0;
#if defined(HAL_INT8_AVX2)
        if (pairs_kernel) c = w8_avx2_columns<SS>(job, m, c0, c1, s0, s1, out);
        else c = w8_avx2_sweep1<SS>(xq.data(), xqsum.data(), segs.data(), s0, s1, perm, qw, n, scales, zeros,
                                    float(zdef), c0, c1, out);
#endif
        for (; c + step <= c1; c += step) {
            if (gemv) HAL_W8_COLS(4);
            else HAL_W8_COLS(2);
        }
        for (; c + W <= c1; c += W) HAL_W8_COLS(1);
#undef HAL_W8_COLS
        for (; c < c1; ++c)
            for (int64_t r = 0; r < m; ++r) {
                float total = 0.0f;
                for (int64_t sgi = s0; sgi < s1; ++sgi) {
                    float acc = 0.0f;
                    for (int64_t i = segs[sgi].start; i < segs[sgi].end; ++i)
                        acc += xq[r * k + i] * float(qw[(perm ? int64_t(perm[i]) : i) * n + c]);
                    const int64_t col = int64_t(segs[sgi].group) * n + c;
                    const float z = zeros ? float(zeros[col]) : float(zdef);
                    total += SS::scalar(scales + col) * (acc - z * xqsum[r * nseg + sgi]);
                }
                out[r * n + c] = total;
            }
    };
    // Small M: K in parts (parts.inl), segments split evenly; the integer kernels of w8a8_vnni.inl cut them alike.
    const int64_t parts = gemv ? k_part_count(k_parts, nseg) : 1;
    run_k_parts(parts, m, n, n, tile, 0, y, threads, [&](int64_t p, int64_t c0, int64_t c1, float *out, float *) {
        columns(c0, c1, nseg * p / parts, nseg * (p + 1) / parts, out);
    });
    parallel_for(m, threads, [&](int64_t r) {
        float *yr = y + r * n;
        const float s = bad[r] ? kNaN : sx[r];
        for (int64_t i = 0; i < n; ++i) yr[i] *= s;
    });
    return HAL_OK;
}

#if defined(HAL_ISA_VNNI)
#include "w8a8_vnni.inl"
#endif

int w8a8_gemm(const hal_cpu_w8a8_gemm_args *args) {
    try {
        const hal_cpu_w8a8_gemm_args &a = *args;
        const std::vector<Segment> segs = w8_segments(a.group_starts, a.group_of_run, a.runs);
        const int32_t sdt = a.s_dtype;
#define HAL_W8_CALL(KERNEL, SS) KERNEL<SS>(a, segs)
#if defined(HAL_ISA_VNNI)
#define HAL_W8_KERNEL w8a8_vnni_t
#else
#define HAL_W8_KERNEL w8a8_t
#endif
        if (sdt == HAL_F16) return HAL_W8_CALL(HAL_W8_KERNEL, F16);
        if (sdt == HAL_BF16) return HAL_W8_CALL(HAL_W8_KERNEL, BF16);
        return HAL_W8_CALL(HAL_W8_KERNEL, F32);
#undef HAL_W8_KERNEL
#undef HAL_W8_CALL
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
