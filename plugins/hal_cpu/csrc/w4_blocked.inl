// w4_blocked.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A16 for large M: a cache-blocked float32 GEMM whose B panels are dequantised from int4
// ---------------------------------------------------------------------------------------------
//
// y[M, N] = x[M, K] @ dequant(w)[K, N], blocked like a BLAS GEMM:
//   - A (the activations) is packed once per call into strips of kMR rows, k-major
//     (Ap[strip][k][kMR], float32, rows past M zero): M_pad * K floats, bounded by the activations.
//   - Each task owns kNC columns. For each block of kKC rows of K it dequantises B[kc, kNC] from the
//     packed codes into a buffer of its own, laid out as kNR-column strips, k-major
//     (Bp[strip][k][kNR]): kKC * kNC floats, sized for L2. The weight is never held in float beyond it.
//   - A micro-kernel keeps a kMR x kNR tile of y in registers (kMR * kNR / W accumulators), one
//     vector load of B and kMR broadcasts of A per k; the A strip stays in L1, the B panel in L2.
// Products are plain IEEE float32 products of x and (q - z) * s, so non-finite activations give
// what the float64 reference gives (NaN rows in, NaN rows out; inf times a zero weight is NaN).

#if defined(HAL_ISA_AVX512)
constexpr int kMR = 8, kNV = 2;  // 8 x 32 tile: 16 zmm accumulators, 2 for B, 1 broadcast (6 or 12 rows: no faster)
#elif defined(HAL_ISA_AVX2)
constexpr int kMR = 6, kNV = 2;  // 6 x 16 tile: 12 ymm accumulators, 2 for B, 1 broadcast
#else
constexpr int kMR = 4, kNV = 2;
#endif
constexpr int kNR = kNV * W;
constexpr int64_t kKC = 256;  // rows of K per dequantised panel (a multiple of 8: whole packed words; 512: no faster)
constexpr int64_t kNC = 256;  // columns per task and panel (a multiple of kNR); panel = kKC * kNC floats = 256 KiB

// c[mr][nr] (+)= sum_k a[k][mr] * b[k][nr] for one kMR x kNR tile; `accumulate` adds to c.
template <int MR>
inline void w4_micro(int64_t kc, const float *a, const float *b, float *c, int64_t ldc, bool accumulate) {
    V::f acc[MR][kNV];
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kNV; ++v) acc[i][v] = accumulate ? V::load(c + i * ldc + v * W) : V::zero();
    for (int64_t p = 0; p < kc; ++p) {
        V::f bv[kNV];
        for (int v = 0; v < kNV; ++v) bv[v] = V::load(b + p * kNR + v * W);
        for (int i = 0; i < MR; ++i) {
            const V::f av = V::set1(a[p * kMR + i]);
            for (int v = 0; v < kNV; ++v) acc[i][v] = V::fma(av, bv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kNV; ++v) V::store(c + i * ldc + v * W, acc[i][v]);
}

// A tile at the edge (rows past M or columns past N): computed into a local tile, valid part copied.
inline void w4_micro_edge(int64_t kc, const float *a, const float *b, float *c, int64_t ldc, bool accumulate,
                          int64_t rows, int64_t cols) {
    alignas(64) float tile[kMR * kNR];
    for (int64_t i = 0; i < kMR; ++i)
        for (int64_t j = 0; j < kNR; ++j) tile[i * kNR + j] = accumulate && i < rows && j < cols ? c[i * ldc + j] : 0.0f;
    w4_micro<kMR>(kc, a, b, tile, kNR, true);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = tile[i * kNR + j];
}

// Rows [p0, p0 + kc) and columns [n0, n0 + nc) of dequant(w) into bp (kNR-column strips, k-major);
// columns past N are zero.
template <class SS>
inline void w4_dequant_panel(const uint32_t *qw, int64_t n, const typename SS::T *scales, const uint8_t *zeros,
                             float zdef, const int32_t *g_idx, int64_t gsize, int64_t p0, int64_t kc, int64_t n0,
                             int64_t nc, float *bp) {
    const V::i mask = V::seti(0xFu);
    const V::f zd = V::set1(zdef);
    const int64_t strips = (nc + kNR - 1) / kNR;
    for (int64_t r = p0; r < p0 + kc; ++r) {
        const int64_t g = g_idx ? g_idx[r] : r / gsize;
        const uint32_t *wrow = qw + (r / 8) * n + n0;
        const typename SS::T *srow = scales + g * n + n0;
        const uint8_t *zrow = zeros ? zeros + g * n + n0 : nullptr;
        const int shift = int(4 * (r % 8));
        float *out = bp + (r - p0) * kNR;
        for (int64_t s = 0; s < strips; ++s) {
            float *o = out + s * kc * kNR;
            for (int v = 0; v < kNV; ++v) {
                const int64_t c = s * kNR + v * W;
                if (c + W <= nc) {
                    V::i w = V::loadi(wrow + c);
                    switch (shift) {  // immediate shifts
                        case 0: break;
                        case 4: w = V::srli<4>(w); break;
                        case 8: w = V::srli<8>(w); break;
                        case 12: w = V::srli<12>(w); break;
                        case 16: w = V::srli<16>(w); break;
                        case 20: w = V::srli<20>(w); break;
                        case 24: w = V::srli<24>(w); break;
                        default: w = V::srli<28>(w); break;
                    }
                    const V::f z = zrow ? V::load_u8(zrow + c) : zd;
                    V::store(o + v * W, V::mul(V::sub(V::cvt(V::andi(w, mask)), z), vload<SS>(srow + c)));
                } else {
                    for (int64_t l = 0; l < W; ++l) {
                        const int64_t cc = c + l;
                        if (cc < nc) {
                            const float q = float((wrow[cc] >> shift) & 0xFu);
                            o[v * W + l] = (q - (zrow ? float(zrow[cc]) : zdef)) * SS::scalar(srow + cc);
                        } else {
                            o[v * W + l] = 0.0f;
                        }
                    }
                }
            }
        }
    }
}

template <class SS>
int w4a16_blocked_t(const hal_cpu_w4a16_blocked_args &a) {
    const void *x = a.x;
    const int32_t xdt = a.x_dtype, zdef = a.default_zero, threads = a.threads;
    const int64_t xstride = a.x_stride, m = a.m, k = a.k, n = a.n, gsize = a.group_size;
    const uint32_t *qw = a.qweight;
    const uint8_t *zeros = a.zeros;
    const int32_t *g_idx = a.g_idx;
    float *y = a.y;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const int64_t mstrips = (m + kMR - 1) / kMR;
    // Packed activations: M_pad * K floats, and one float32 row per strip to convert through.
    std::vector<float> ap(size_t(mstrips) * kMR * k), rows32(size_t(mstrips) * k);
    parallel_for(mstrips, threads, [&](int64_t s) {
        float *tmp = rows32.data() + s * k;
        float *dst = ap.data() + s * kMR * k;
        for (int64_t i = 0; i < kMR; ++i) {
            const int64_t r = s * kMR + i;
            if (r < m) any_row_to_f32(row_ptr(x, xdt, r, xstride), xdt, k, tmp);
            else std::fill(tmp, tmp + k, 0.0f);
            for (int64_t p = 0; p < k; ++p) dst[p * kMR + i] = tmp[p];
        }
    });
    const int64_t blocks = (n + kNC - 1) / kNC;
    std::atomic<bool> failed{false};
    parallel_for(blocks, threads, [&](int64_t t) {
        const int64_t n0 = t * kNC, nc = std::min(kNC, n - n0);
        // The task's dequantised panel: kKC * kNC floats (256 KiB), freed when the task ends.
        float *bp = new (std::nothrow) float[size_t(kKC) * kNC];
        if (!bp) {
            failed = true;
            return;
        }
        for (int64_t p0 = 0; p0 < k; p0 += kKC) {
            const int64_t kc = std::min(kKC, k - p0);
            w4_dequant_panel<SS>(qw, n, scales, zeros, float(zdef), g_idx, gsize, p0, kc, n0, nc, bp);
            const bool acc = p0 > 0;
            for (int64_t s = 0; s < mstrips; ++s) {
                const float *a = ap.data() + s * kMR * k + p0 * kMR;
                const int64_t rows = std::min<int64_t>(kMR, m - s * kMR);
                for (int64_t j = 0; j < nc; j += kNR) {
                    float *c = y + s * kMR * n + n0 + j;
                    const float *b = bp + (j / kNR) * kc * kNR;
                    const int64_t cols = std::min<int64_t>(kNR, nc - j);
                    if (rows == kMR && cols == kNR) w4_micro<kMR>(kc, a, b, c, n, acc);
                    else w4_micro_edge(kc, a, b, c, n, acc, rows, cols);
                }
            }
        }
        delete[] bp;
    });
    return failed ? HAL_ENOMEM : HAL_OK;
}

int w4a16_blocked(const hal_cpu_w4a16_blocked_args *args) {
    try {
        if (args->s_dtype == HAL_F16) return w4a16_blocked_t<F16>(*args);
        if (args->s_dtype == HAL_BF16) return w4a16_blocked_t<BF16>(*args);
        return w4a16_blocked_t<F32>(*args);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}

// 1 when w4a16_gemv multiplies fp16/bf16 activations with AVX512_BF16 dot products (w4_bf16.inl), else 0.
int w4a16_half_dot() {
#if defined(HAL_W4_BF16)
    return cpu_has_avx512_bf16() ? 1 : 0;
#else
    return 0;
#endif
}
