// w4a16.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A16: int4 codes unpacked in registers
// ---------------------------------------------------------------------------------------------
//
// Word [r, n] holds codes of rows 8r..8r+7 in nibbles 0..7. Nibble j is isolated by a mask,
// not shifted down: (w & 0xF << 4j) is q * 16**j exactly, so the activation is pre-scaled
// by 16**-j (exact) and each code costs one and, one convert and one FMA. Nibble 7 is
// shifted by 4 first so that its value stays positive in int32. Zero points and scales are
// applied once per group: sum_k x (q - z) s = s (sum_k x q - z sum_k x).

constexpr float kNibbleScale[8] = {1.0f, 0.0625f, 0.00390625f, 0.000244140625f, 1.52587890625e-05f,
                                   9.5367431640625e-07f, 5.9604644775390625e-08f, 5.9604644775390625e-08f};

//: M up to this: the sweep's tiles are 2 rows x 4 vectors, and the bf16 loop sweeps (w4_bf16_sweep) only up to it.
//: The float32 loop's sweep (w4_sweep) serves every M, in tiles of kW4SweepTileRows rows x 4 vectors above it:
//: at each column step every row tile runs over the pass's codes (in L1 after the first tile).
constexpr int64_t kW4SweepMaxM = 2;
constexpr int kW4SweepTileRows = 4;
//: Rows whose tiles run one column step after the other before the next rows start: their partial sums and
//: activations for a pass stay in L1 beside the pass's codes (which stay in L2 for the next rows).
constexpr int64_t kW4SweepBlockRows = 16;
//: Above the sweep's M the bf16 loop walks K in chunks of about this many packed rows (1024 k), so that a row tile's
//: activations for one chunk stay in L1 across the task's columns.
constexpr int64_t kW4ChunkRows = 128;
//: Packed rows (8 k each) per pass of the sweep. Measured on a 2-core Zen 4 (4096x11008, M=1, weight in DRAM):
//: 8 rows reach ~30 GB/s, 4 rows ~27, 16 rows (a whole G=128 group) ~15-20; ranges cut into 4-8 tasks per thread
//: instead of one drop to 15-20 GB/s: short runs a row apart are what the prefetchers do not follow.
constexpr int64_t kW4PassRows = 8;
//: Packed rows per pass when K is cut into parts (parts.inl): each task then crosses whole rows, and 4 rows
//: per pass measured 5-10 % faster than 8 there (11008x4096, interleaved A/B).
constexpr int64_t kW4SplitPassRows = 4;
//: The sweep prefetches each packed row this many words (512 bytes) ahead of its loads, into L2: with N a multiple
//: of 1024 words the 8 rows of a pass share L1 sets.
constexpr int64_t kW4PrefetchWords = 128;
//: Vectors per sweep step: 4 zmm (64 columns, 256 bytes a packed row); 2 for narrower vectors, whose register
//: file (16 on AVX2) would not hold 2 rows x 4 accumulators beside the codes.
constexpr int kW4SweepNV = W >= 16 ? 4 : 2;

// Where the sweep prefetches while it loads packed row r at column c of its range [c0, c1), in a pass of `pass` rows:
// kW4PrefetchWords ahead in the same row, or, within that distance of the range's end, as far into the same row of
// the next pass, so that the streams do not restart cold at every pass. (With N = 4096 on two threads a pass crosses
// only 8 KiB a row.) Past the last row it names the current position, already loaded.
inline const uint32_t *w4_sweep_prefetch(const uint32_t *qw, int64_t n, int64_t rows, int64_t pass, int64_t r,
                                         int64_t c, int64_t c0, int64_t c1) {
    const int64_t ahead = c + kW4PrefetchWords;
    if (ahead < c1) return qw + r * n + ahead;
    const int64_t next = r + pass;
    return next < rows ? qw + next * n + c0 + (ahead - c1) : qw + r * n + c;
}

// The small-M sweep's tasks (parts.inl): sweep(g0, g1, pass, c0, c1, out, part) for groups [g0, g1) of each
// part of K and each column range, `pass` packed rows a pass, `part` the task's m x tile partial-sum buffer.
template <class Sweep>
void w4_sweep_parts(int32_t k_parts, int64_t ngroups, int64_t m, int64_t n, int64_t cols, int64_t tile, float *y,
                    int32_t threads, Sweep &&sweep) {
    const int64_t parts = k_part_count(k_parts, ngroups), pass = parts > 1 ? kW4SplitPassRows : kW4PassRows;
    run_k_parts(parts, m, n, cols, tile, m * tile, y, threads,
                [&](int64_t p, int64_t c0, int64_t c1, float *out, float *part) {
                    sweep(ngroups * p / parts, ngroups * (p + 1) / parts, pass, c0, c1, out, part);
                });
}

// acc[mb][v] += packed row r (codes w[v]) times the pre-scaled activations xr[mb * k + j], j = nibble.
template <int MB, int NV>
inline void w4_row(V::f (&acc)[MB][NV], const V::i (&w)[NV], const float *xr, int64_t k) {
#define HAL_W4_STEP(J, EXPR)                                                               \
    {                                                                                      \
        V::f wf[NV];                                                                       \
        for (int v = 0; v < NV; ++v) wf[v] = V::cvt(EXPR);                                 \
        for (int mb = 0; mb < MB; ++mb) {                                                  \
            const V::f xb = V::set1(xr[mb * k + J]);                                       \
            for (int v = 0; v < NV; ++v) acc[mb][v] = V::fma(xb, wf[v], acc[mb][v]);       \
        }                                                                                  \
    }
    HAL_W4_STEP(0, V::andi(w[v], V::seti(0xFu << 0)))
    HAL_W4_STEP(1, V::andi(w[v], V::seti(0xFu << 4)))
    HAL_W4_STEP(2, V::andi(w[v], V::seti(0xFu << 8)))
    HAL_W4_STEP(3, V::andi(w[v], V::seti(0xFu << 12)))
    HAL_W4_STEP(4, V::andi(w[v], V::seti(0xFu << 16)))
    HAL_W4_STEP(5, V::andi(w[v], V::seti(0xFu << 20)))
    HAL_W4_STEP(6, V::andi(w[v], V::seti(0xFu << 24)))
    HAL_W4_STEP(7, V::andi(V::srli<4>(w[v]), V::seti(0xFu << 24)))
#undef HAL_W4_STEP
}

//: Independent sums per vector of a one-row sweep tile, nibble j adding into sum j % kW4OneRowSums: a single chain
//: of 8 dependent FMAs per packed row is bound by the FMA latency, not the pipes (AVX2 sweeps 2 vectors: 2 chains
//: at M = 1). Summed in a fixed order, ((s0 + s1) + (s2 + s3)), whatever the threads and tiles. Measured on a
//: 2-core AVX2 EPYC (M = 1, bf16, weights rotated past the caches): 1.2-1.5x, 17-21 GB/s from 13-14. Tiles of two
//: rows keep one sum a vector: two sums there spill registers on AVX2 (0.86x at 4096 x 4096, M = 2).
constexpr int kW4OneRowSums = W == 8 ? 4 : W >= 16 ? 2 : 1;

// acc[mb][j % S][v] += nibble j of a packed row (codes w[v]) times the pre-scaled activation xr[mb * k + j].
template <int R, int S, int NV>
inline void w4_row_sums(V::f (&acc)[R][S][NV], const V::i (&w)[NV], const float *xr, int64_t k) {
#define HAL_W4_STEP(J, EXPR)                                                                     \
    {                                                                                            \
        V::f wf[NV];                                                                             \
        for (int v = 0; v < NV; ++v) wf[v] = V::cvt(EXPR);                                       \
        for (int mb = 0; mb < R; ++mb) {                                                         \
            const V::f xb = V::set1(xr[mb * k + J]);                                             \
            for (int v = 0; v < NV; ++v) acc[mb][(J) % S][v] = V::fma(xb, wf[v], acc[mb][(J) % S][v]); \
        }                                                                                        \
    }
    HAL_W4_STEP(0, V::andi(w[v], V::seti(0xFu << 0)))
    HAL_W4_STEP(1, V::andi(w[v], V::seti(0xFu << 4)))
    HAL_W4_STEP(2, V::andi(w[v], V::seti(0xFu << 8)))
    HAL_W4_STEP(3, V::andi(w[v], V::seti(0xFu << 12)))
    HAL_W4_STEP(4, V::andi(w[v], V::seti(0xFu << 16)))
    HAL_W4_STEP(5, V::andi(w[v], V::seti(0xFu << 20)))
    HAL_W4_STEP(6, V::andi(w[v], V::seti(0xFu << 24)))
    HAL_W4_STEP(7, V::andi(V::srli<4>(w[v]), V::seti(0xFu << 24)))
#undef HAL_W4_STEP
}

// base + s (acc - z sum x): group g's contribution to W columns from col = g * n + column.
template <class SS>
inline V::f w4_fold(V::f acc, V::f base, const typename SS::T *scales, const uint8_t *zeros, float zdef,
                    int64_t col, float xsum) {
    const V::f s = vload<SS>(scales + col);
    const V::f z = zeros ? V::load_u8(zeros + col) : V::set1(zdef);
    return V::fma(s, V::fnma(z, V::set1(xsum), acc), base);
}

// Columns [n0, n0 + W NV) of MB rows, each column walking every packed row: totals stay in registers.
template <class SS, int MB, int NV>
inline void w4_tile(const float *xs, int64_t k, const float *xsum, int64_t ngroups, const uint32_t *qw, int64_t n,
                    int64_t n0, const typename SS::T *scales, const uint8_t *zeros, float zdef, int64_t gsize,
                    float *y, int64_t ldy) {
    V::f tot[MB][NV];
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) tot[mb][v] = V::zero();
    const int64_t words = gsize / 8;
    for (int64_t g = 0; g < ngroups; ++g) {
        V::f acc[MB][NV];
        for (int mb = 0; mb < MB; ++mb)
            for (int v = 0; v < NV; ++v) acc[mb][v] = V::zero();
        for (int64_t r = g * words; r < (g + 1) * words; ++r) {
            const uint32_t *wrow = qw + r * n + n0;
            V::i w[NV];
            for (int v = 0; v < NV; ++v) w[v] = V::loadi(wrow + v * W);
            w4_row<MB, NV>(acc, w, xs + 8 * r, k);
        }
        for (int v = 0; v < NV; ++v)
            for (int mb = 0; mb < MB; ++mb)
                tot[mb][v] = w4_fold<SS>(acc[mb][v], tot[mb][v], scales, zeros, zdef, g * n + n0 + v * W,
                                         xsum[mb * ngroups + g]);
    }
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) V::store(y + mb * ldy + n0 + v * W, tot[mb][v]);
}

// What one sweep task reads and writes: every row of x (pre-scaled, row stride k) and its group sums, the weight,
// out (row stride n) for the totals and part[m][width] for a group's partial sums between passes.
template <class SS>
struct W4Sweep {
    const float *xs;
    int64_t k;
    const float *xsum;
    int64_t ngroups;
    const uint32_t *qw;
    int64_t n;
    const typename SS::T *scales;
    const uint8_t *zeros;
    float zdef;
    float *out, *part;
    int64_t c0, width;
};

// Rows [row, row + R) x columns [c, c + W NV) over packed rows [r0, r1) of group g (a pass): the partial sums
// start at zero (first pass of the group) or from part, and go back to part, or (last pass) are folded into out.
// Split: the sweep's tiles are of 1 or 2 rows (M <= kW4SweepMaxM), and a one-row tile sums in kW4OneRowSums sums a
// vector; the tiles of a larger M keep one sum a vector, so that every row of a call is summed alike.
template <class SS, int R, int NV, bool Split>
inline void w4_sweep_tile(const W4Sweep<SS> &s, int64_t row, int64_t c, int64_t g, int64_t r0, int64_t r1,
                          bool first, bool last, int64_t pf_rows) {
    float *pc = s.part + row * s.width + (c - s.c0);
    constexpr int S = Split && R == 1 ? kW4OneRowSums : 1;
    V::f acc[R][NV];
    for (int mb = 0; mb < R; ++mb)
        for (int v = 0; v < NV; ++v) acc[mb][v] = first ? V::zero() : V::load(pc + mb * s.width + v * W);
    [[maybe_unused]] V::f sums[R][S][NV];
    if constexpr (S > 1)
        for (int mb = 0; mb < R; ++mb)
            for (int j = 0; j < S; ++j)
                for (int v = 0; v < NV; ++v) sums[mb][j][v] = j == 0 ? acc[mb][v] : V::zero();
    for (int64_t r = r0; r < r1; ++r) {
        const uint32_t *wrow = s.qw + r * s.n + c;
        if (pf_rows) {
            const uint32_t *pf = w4_sweep_prefetch(s.qw, s.n, pf_rows, r1 - r0, r, c, s.c0, s.c0 + s.width);
            for (int v = 0; v < NV; v += 16 / W) __builtin_prefetch(pf + v * W, 0, 2);
        }
        V::i w[NV];
        for (int v = 0; v < NV; ++v) w[v] = V::loadi(wrow + v * W);
        if constexpr (S > 1) w4_row_sums<R, S, NV>(sums, w, s.xs + row * s.k + 8 * r, s.k);
        else w4_row<R, NV>(acc, w, s.xs + row * s.k + 8 * r, s.k);
    }
    for (int mb = 0; mb < R; ++mb)
        for (int v = 0; v < NV; ++v) {
            if constexpr (S == 2) acc[mb][v] = V::add(sums[mb][0][v], sums[mb][1][v]);
            if constexpr (S == 4)
                acc[mb][v] = V::add(V::add(sums[mb][0][v], sums[mb][1][v]), V::add(sums[mb][2][v], sums[mb][3][v]));
        }
    for (int mb = 0; mb < R; ++mb)
        for (int v = 0; v < NV; ++v) {
            if (!last) {
                V::store(pc + mb * s.width + v * W, acc[mb][v]);
                continue;
            }
            float *yc = s.out + (row + mb) * s.n + c + v * W;
            V::store(yc, w4_fold<SS>(acc[mb][v], V::load(yc), s.scales, s.zeros, s.zdef, g * s.n + c + v * W,
                                     s.xsum[(row + mb) * s.ngroups + g]));
        }
}

// The last rows [row, row + rest) of the sweep, rest < R.
template <class SS, int R, int NV, bool Split>
inline void w4_sweep_rest(const W4Sweep<SS> &s, int64_t rest, int64_t row, int64_t c, int64_t g, int64_t r0,
                          int64_t r1, bool first, bool last, int64_t pf_rows) {
    if constexpr (R > 0) {
        if (rest == R) w4_sweep_tile<SS, R, NV, Split>(s, row, c, g, r0, r1, first, last, pf_rows);
        else w4_sweep_rest<SS, R - 1, NV, Split>(s, rest, row, c, g, r0, r1, first, last, pf_rows);
    }
}

// Columns [c0, c1) of all m rows (c1 - c0 a multiple of W NV) over groups [g0, g1), swept pass by pass, `pass`
// packed rows at a time across the whole range (see kW4PassRows); at each column step every tile of MB rows
// runs over the pass's codes (in L1 after the first tile), so the weight is read once whatever m is. A group's
// partial sums wait between passes in part[m][c1 - c0]; out (row stride n) receives the totals.
template <class SS, int MB, int NV>
inline void w4_sweep(int64_t m, const float *xs, int64_t k, const float *xsum, int64_t ngroups, const uint32_t *qw,
                     int64_t n, int64_t c0, int64_t c1, const typename SS::T *scales, const uint8_t *zeros,
                     float zdef, int64_t gsize, int64_t g0, int64_t g1, int64_t pass, float *out, float *part) {
    const int64_t words = gsize / 8, rows = g1 * words;
    const W4Sweep<SS> s{xs, k, xsum, ngroups, qw, n, scales, zeros, zdef, out, part, c0, c1 - c0};
    for (int64_t mb = 0; mb < m; ++mb) std::fill(out + mb * n + c0, out + mb * n + c1, 0.0f);
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t r_begin = g * words, r_end = r_begin + words;
        for (int64_t r0 = r_begin; r0 < r_end; r0 += pass) {
            const int64_t r1 = std::min(r_end, r0 + pass);
            const bool first = r0 == r_begin, last = r1 == r_end;
            for (int64_t m0 = 0; m0 < m; m0 += kW4SweepBlockRows) {
            const int64_t m1 = std::min(m, m0 + kW4SweepBlockRows);
            for (int64_t c = c0; c < c1; c += W * NV) {
                int64_t row = m0;
                for (; row + MB <= m1; row += MB)
                    w4_sweep_tile<SS, MB, NV, (MB <= 2)>(s, row, c, g, r0, r1, first, last, row == 0 ? rows : 0);
                w4_sweep_rest<SS, MB - 1, NV, (MB <= 2)>(s, m1 - row, row, c, g, r0, r1, first, last,
                                                        row == 0 ? rows : 0);
            }
            }
        }
    }
}

// Columns [n0, n1) that do not fill a vector: scalar.
template <class SS>
inline void w4_scalar_cols(const float *x32, int64_t m, int64_t k, const uint32_t *qw, int64_t n, int64_t n0,
                           int64_t n1, const typename SS::T *scales, const uint8_t *zeros, float zdef, int64_t gsize,
                           float *y) {
    for (int64_t c = n0; c < n1; ++c)
        for (int64_t r = 0; r < m; ++r) {
            float total = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) {
                const int64_t g = kk / gsize;
                const float q = float((qw[(kk / 8) * n + c] >> (4 * (kk % 8))) & 0xFu);
                const float z = zeros ? float(zeros[g * n + c]) : zdef;
                total += x32[r * k + kk] * ((q - z) * SS::scalar(scales + g * n + c));
            }
            y[r * n + c] = total;
        }
}

template <class SS, int NV>
inline void w4_rows(int64_t rows, const float *xs, int64_t k, const float *xsum, int64_t ngroups,
                    const uint32_t *qw, int64_t n, int64_t n0, const typename SS::T *sc, const uint8_t *zeros,
                    float zdef, int64_t gsize, float *y) {
    constexpr int MB = NV >= 4 ? 1 : (W >= 16 ? 6 : 2);  // accumulators and totals fill the register file
    for (int64_t r = 0; r < rows;) {
        const int64_t left = std::min<int64_t>(MB, rows - r);
#define HAL_W4_ROWS(R) w4_tile<SS, R, NV>(xs + r * k, k, xsum + r * ngroups, ngroups, qw, n, n0, sc, zeros, zdef, \
                                          gsize, y + r * n, n)
        if (left >= MB) HAL_W4_ROWS(MB);
        else if (MB > 4 && left >= 4) { HAL_W4_ROWS(4 <= MB ? 4 : 1); r += 4; continue; }
        else if (left >= 2) { HAL_W4_ROWS(2 <= MB ? 2 : 1); r += 2; continue; }
        else HAL_W4_ROWS(1);
#undef HAL_W4_ROWS
        r += left >= MB ? MB : 1;
    }
}

#include "w4_bf16.inl"

template <class SS>
int w4a16_t(const hal_cpu_w4a16_gemv_args &a) {
    const void *x = a.x;
    const int32_t xdt = a.x_dtype, zdef = a.default_zero, k_parts = a.k_parts, threads = a.threads;
    const int64_t xstride = a.x_stride, m = a.m, k = a.k, n = a.n, gsize = a.group_size, n_tile = a.n_tile;
    const uint32_t *qw = a.qweight;
    const uint8_t *zeros = a.zeros;
    float *y = a.y;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const int64_t ngroups = k / gsize;
    // Bounded by the activations: x in float32, its group sums and (float32 path) its pre-scaled copy.
    std::vector<float> x32(size_t(m) * k), xsum(size_t(m) * ngroups);
    parallel_for(m, threads, [&](int64_t r) {
        float *xr = x32.data() + r * k;
        any_row_to_f32(row_ptr(x, xdt, r, xstride), xdt, k, xr);
        for (int64_t g = 0; g < ngroups; ++g) {
            float s = 0.0f;
            for (int64_t kk = g * gsize; kk < (g + 1) * gsize; ++kk) s += xr[kk];
            xsum[r * ngroups + g] = s;
        }
    });
#if defined(HAL_W4_BF16) && !defined(HAL_W4_NO_BF16)
    if (w4a16_bf16<SS>(a, x32, xsum)) {
        w4_scalar_cols<SS>(x32.data(), m, k, qw, n, n / W * W, n, scales, zeros, float(zdef), gsize, y);
        return HAL_OK;
    }
#endif
    std::vector<float> xs(size_t(m) * k);
    parallel_for(m, threads, [&](int64_t r) {
        for (int64_t kk = 0; kk < k; ++kk) xs[r * k + kk] = x32[r * k + kk] * kNibbleScale[kk % 8];
    });
    constexpr int64_t nv = kW4SweepNV;
    const int64_t tile = std::max<int64_t>(n_tile, nv * W) / (nv * W) * (nv * W);
    const int64_t full = n / (nv * W) * (nv * W);
    w4_sweep_parts(k_parts, ngroups, m, n, full, tile, y, threads,
                   [&](int64_t g0, int64_t g1, int64_t pass, int64_t c0, int64_t c1, float *out, float *part) {
        if (m <= kW4SweepMaxM)
            w4_sweep<SS, 2, kW4SweepNV>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c0, c1, scales, zeros,
                                        float(zdef), gsize, g0, g1, pass, out, part);
        else
            w4_sweep<SS, kW4SweepTileRows, kW4SweepNV>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c0, c1, scales,
                                                      zeros, float(zdef), gsize, g0, g1, pass, out, part);
    });
    int64_t c = full;
    for (; c + W <= n; c += W)
        w4_rows<SS, 1>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c, scales, zeros, float(zdef), gsize, y);
    w4_scalar_cols<SS>(x32.data(), m, k, qw, n, c, n, scales, zeros, float(zdef), gsize, y);
    return HAL_OK;
}

int w4a16_gemv(const hal_cpu_w4a16_gemv_args *args) {
    try {
        if (args->s_dtype == HAL_F16) return w4a16_t<F16>(*args);
        if (args->s_dtype == HAL_BF16) return w4a16_t<BF16>(*args);
        return w4a16_t<F32>(*args);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
