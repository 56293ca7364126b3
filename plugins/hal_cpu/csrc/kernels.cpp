// hal-cpu's kernels, written once against the vector layer in isa.h.
//
// This file is compiled once per instruction-set variant (see setup.py); each
// compilation defines its kernels in namespace hal::<variant> and exports one
// KernelTable through hal_kernels_<variant>(). dispatch.cpp picks the table at
// load time. Nothing here allocates more than the bounded workspaces named in
// docs/cpu.md, and every kernel reads its operands in their storage dtype.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "common.h"
#include "hal_cpu_kernels.h"
#include "isa.h"

namespace hal {
namespace HAL_ISA_NAME {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int W = V::W;

template <class S>
inline V::f vload(const typename S::T *p) {
    return V::load(static_cast<const S *>(nullptr), p);
}

// ---------------------------------------------------------------------------------------------
// paged_attention
// ---------------------------------------------------------------------------------------------

//: Tokens scored per step (a block, or a slice of a long block); a multiple of every W.
constexpr int kChunk = 32;
//: Tokens ahead of the current chunk whose K/V rows are prefetched (a few blocks; they fit in L2).
constexpr int64_t kLookahead = 96;

struct AttnArgs {
    const void *query;
    int64_t qs, qh;
    const void *kc, *vc;
    int64_t cb, ch, ct;
    const int32_t *bt;
    int64_t bts;
    const int32_t *sl;
    float *out;
    int32_t num_seqs, num_heads, num_kv_heads, block_size, d, gq;
    float scale;
};

// sc[g * kChunk] = q_g . k for G query heads of one key row (the row is loaded once for all G).
template <class S, int G>
inline void qk_row(const float *q, int d, const typename S::T *k, float *sc) {
    V::f acc[G];
    for (int g = 0; g < G; ++g) acc[g] = V::zero();
    int c = 0;
    for (; c + W <= d; c += W) {
        V::f kv = vload<S>(k + c);
        for (int g = 0; g < G; ++g) acc[g] = V::fma(V::load(q + g * d + c), kv, acc[g]);
    }
    float sums[G + 3];
    int g = 0;
    for (; g + 4 <= G; g += 4) V::hsum4(acc[g], acc[g + 1], acc[g + 2], acc[g + 3], sums + g);
    for (; g < G; ++g) sums[g] = V::hsum(acc[g]);
    for (g = 0; g < G; ++g) {
        float s = sums[g];
        for (int e = c; e < d; ++e) s += q[g * d + e] * S::scalar(k + e);
        sc[g * kChunk] = s;
    }
}

// acc[g] += sum_t p[g][t] * v_t for G heads over T value rows, accumulators in registers per W lanes.
template <class S, int G>
inline void pv_rows(float *acc, int d, const float *p, int T, const typename S::T *v, int64_t vstride) {
    int c = 0;
    for (; c + W <= d; c += W) {
        V::f a[G];
        for (int g = 0; g < G; ++g) a[g] = V::load(acc + g * d + c);
        for (int t = 0; t < T; ++t) {
            V::f vv = vload<S>(v + t * vstride + c);
            for (int g = 0; g < G; ++g) a[g] = V::fma(V::set1(p[g * kChunk + t]), vv, a[g]);
        }
        for (int g = 0; g < G; ++g) V::store(acc + g * d + c, a[g]);
    }
    for (; c < d; ++c)
        for (int g = 0; g < G; ++g)
            for (int t = 0; t < T; ++t) acc[g * d + c] += p[g * kChunk + t] * S::scalar(v + t * vstride + c);
}

template <class S, int G>
inline void heads_step(const float *q, float *acc, float *sc, int d, int T, const typename S::T *k,
                       const typename S::T *v, int64_t ct, bool scores) {
    if (scores) {
        for (int t = 0; t < T; ++t) qk_row<S, G>(q, d, k + t * ct, sc + t);
    } else {
        pv_rows<S, G>(acc, d, sc, T, v, ct);
    }
}

// Groups of up to 8 query heads share each loaded row.
template <class S>
inline void for_heads(int gq, const float *q, float *acc, float *sc, int d, int T, const typename S::T *k,
                      const typename S::T *v, int64_t ct, bool scores) {
    for (int g0 = 0; g0 < gq; g0 += 8) {
        const float *qg = q + int64_t(g0) * d;
        float *ag = acc + int64_t(g0) * d;
        float *sg = sc + int64_t(g0) * kChunk;
        switch (std::min(8, gq - g0)) {
            case 1: heads_step<S, 1>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 2: heads_step<S, 2>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 3: heads_step<S, 3>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 4: heads_step<S, 4>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 5: heads_step<S, 5>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 6: heads_step<S, 6>(qg, ag, sg, d, T, k, v, ct, scores); break;
            case 7: heads_step<S, 7>(qg, ag, sg, d, T, k, v, ct, scores); break;
            default: heads_step<S, 8>(qg, ag, sg, d, T, k, v, ct, scores); break;
        }
    }
}

template <class T>
inline void prefetch_rows(const T *base, int rows, int64_t stride, int d) {
    const int64_t bytes = int64_t(d) * sizeof(T);
    for (int r = 0; r < rows; ++r) {
        const char *row = reinterpret_cast<const char *>(base + r * stride);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
    }
}

// Tokens [t0, t1) of sequence s for KV head kvh: online softmax in fp32.
// Writes either the normalised output rows (final) or (max, denominator, acc[d]) per head to part.
// NaN scores, or a max of +/-inf, poison the head (NaN out), as in the float64 reference.
template <class S>
void attn_task(const AttnArgs &a, int s, int kvh, int64_t t0, int64_t t1, float *part, bool final) {
    using T = typename S::T;
    const int gq = a.gq, d = a.d;
    std::vector<float> buf(size_t(gq) * (2 * d + kChunk + 3));
    float *q = buf.data(), *acc = q + size_t(gq) * d, *sc = acc + size_t(gq) * d;
    float *m = sc + size_t(gq) * kChunk, *l = m + gq, *poisoned = l + gq;
    const T *query = static_cast<const T *>(a.query);
    for (int g = 0; g < gq; ++g) {
        const T *qrow = query + s * a.qs + int64_t(kvh * gq + g) * a.qh;
        for (int e = 0; e < d; ++e) q[g * d + e] = S::scalar(qrow + e) * a.scale;
        m[g] = -kInf;
        l[g] = 0.0f;
        poisoned[g] = 0.0f;
    }
    std::fill(acc, acc + size_t(gq) * d, 0.0f);
    const T *kc = static_cast<const T *>(a.kc), *vc = static_cast<const T *>(a.vc);
    const int bs = a.block_size;
    int64_t prefetched = t0;
    for (int64_t t = t0; t < t1;) {
        const int64_t j = t / bs, off = t % bs;
        const int T_ = int(std::min<int64_t>({int64_t(bs) - off, t1 - t, int64_t(kChunk)}));
        const int64_t blk = a.bt[s * a.bts + j];
        const int64_t base = blk * a.cb + kvh * a.ch + off * a.ct;
        // Blocks are scattered: keep the rows of the next kLookahead tokens in flight while this chunk computes.
        for (const int64_t until = std::min(t1, t + T_ + kLookahead); prefetched < until;) {
            const int64_t jn = prefetched / bs, offn = prefetched % bs;
            const int Tn = int(std::min<int64_t>(int64_t(bs) - offn, until - prefetched));
            const int64_t nbase = int64_t(a.bt[s * a.bts + jn]) * a.cb + kvh * a.ch + offn * a.ct;
            prefetch_rows(kc + nbase, Tn, a.ct, d);
            prefetch_rows(vc + nbase, Tn, a.ct, d);
            prefetched += Tn;
        }
        if (T_ < kChunk)
            for (int g = 0; g < gq; ++g) std::fill(sc + g * kChunk + T_, sc + (g + 1) * kChunk, -kInf);
        for_heads<S>(gq, q, acc, sc, d, T_, kc + base, vc + base, a.ct, true);
        for (int g = 0; g < gq; ++g) {
            float *sg = sc + g * kChunk;
            float mx = -kInf;
            bool nan = false;
            for (int i = 0; i < T_; ++i) {
                nan |= sg[i] != sg[i];
                mx = sg[i] > mx ? sg[i] : mx;
            }
            if (nan) poisoned[g] = 1.0f;
            const float mnew = std::max(m[g], mx);
            const float ms = std::isfinite(mnew) ? mnew : 0.0f;  // -inf so far: every p is exp(-inf) = 0
            const float alpha = m[g] == -kInf ? 0.0f : std::exp(m[g] - ms);
            V::f sum = V::zero();
            const V::f vms = V::set1(ms);
            for (int i = 0; i < kChunk; i += W) {
                V::f p = V::exp(V::sub(V::load(sg + i), vms));
                V::store(sg + i, p);
                sum = V::add(sum, p);
            }
            l[g] = l[g] * alpha + V::hsum(sum);
            if (alpha != 1.0f)
                for (int e = 0; e < d; ++e) acc[g * d + e] *= alpha;
            m[g] = mnew;
        }
        for_heads<S>(gq, q, acc, sc, d, T_, kc + base, vc + base, a.ct, false);
        t += T_;
    }
    for (int g = 0; g < gq; ++g) {
        const bool bad = poisoned[g] != 0.0f || !std::isfinite(m[g]);
        if (final) {
            float *o = a.out + (int64_t(s) * a.num_heads + kvh * gq + g) * d;
            const float inv = 1.0f / l[g];
            for (int e = 0; e < d; ++e) o[e] = bad ? kNaN : acc[g * d + e] * inv;
        } else {
            float *p = part + int64_t(g) * (d + 2);
            p[0] = poisoned[g] != 0.0f ? kNaN : m[g];
            p[1] = l[g];
            std::memcpy(p + 2, acc + size_t(g) * d, sizeof(float) * d);
        }
    }
}

// Log-sum-exp merge of a sequence's partitions for one KV head's query heads.
inline void attn_merge(const AttnArgs &a, int s, int kvh, const float *parts, int nparts) {
    const int gq = a.gq, d = a.d;
    const int64_t pstride = int64_t(gq) * (d + 2);
    for (int g = 0; g < gq; ++g) {
        float *o = a.out + (int64_t(s) * a.num_heads + kvh * gq + g) * d;
        float top = -kInf;
        bool bad = false;
        for (int p = 0; p < nparts; ++p) {
            const float mp = parts[p * pstride + g * (d + 2)];
            bad |= mp != mp;
            top = std::max(top, mp);
        }
        if (bad || !std::isfinite(top)) {
            for (int e = 0; e < d; ++e) o[e] = kNaN;
            continue;
        }
        std::fill(o, o + d, 0.0f);
        float denom = 0.0f;
        for (int p = 0; p < nparts; ++p) {
            const float *pp = parts + p * pstride + g * (d + 2);
            const float w = pp[0] == -kInf ? 0.0f : std::exp(pp[0] - top);
            denom += w * pp[1];
            for (int e = 0; e < d; ++e) o[e] += w * pp[2 + e];
        }
        const float inv = 1.0f / denom;
        for (int e = 0; e < d; ++e) o[e] *= inv;
    }
}

template <class S>
int paged_attention_t(const AttnArgs &a, int32_t partition_tokens, int32_t threads) {
    struct Task { int32_t s, kvh; int64_t t0, t1; int64_t part; };
    std::vector<Task> tasks;
    std::vector<int64_t> first_part(size_t(a.num_seqs) * a.num_kv_heads, -1);
    std::vector<int32_t> nparts(a.num_seqs, 0);
    int64_t parts_total = 0;
    for (int s = 0; s < a.num_seqs; ++s) {
        const int64_t len = a.sl[s];
        if (len <= 0) {
            std::fill(a.out + int64_t(s) * a.num_heads * a.d, a.out + int64_t(s + 1) * a.num_heads * a.d, 0.0f);
            continue;
        }
        const int64_t ptok = partition_tokens > 0 ? partition_tokens : len;
        const int np = int((len + ptok - 1) / ptok);
        nparts[s] = np;
        for (int h = 0; h < a.num_kv_heads; ++h) {
            if (np > 1) first_part[size_t(s) * a.num_kv_heads + h] = parts_total;
            for (int p = 0; p < np; ++p)
                tasks.push_back({s, h, p * ptok, std::min(len, (p + 1) * ptok), np > 1 ? parts_total + p : -1});
            if (np > 1) parts_total += np;
        }
    }
    std::vector<float> parts(size_t(parts_total) * a.gq * (a.d + 2));
    // Longest tasks first: dynamic scheduling then balances the ragged tail.
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task &x, const Task &y) { return x.t1 - x.t0 > y.t1 - y.t0; });
    const int64_t pstride = int64_t(a.gq) * (a.d + 2);
    parallel_for(int64_t(tasks.size()), threads, [&](int64_t i) {
        const Task &t = tasks[i];
        attn_task<S>(a, t.s, t.kvh, t.t0, t.t1, t.part >= 0 ? parts.data() + t.part * pstride : nullptr, t.part < 0);
    });
    if (parts_total) {
        parallel_for(int64_t(a.num_seqs) * a.num_kv_heads, threads, [&](int64_t i) {
            const int64_t fp = first_part[i];
            if (fp >= 0) {
                const int s = int(i / a.num_kv_heads);
                attn_merge(a, s, int(i % a.num_kv_heads), parts.data() + fp * pstride, nparts[s]);
            }
        });
    }
    return HAL_OK;
}

int paged_attention(const void *query, int64_t qs, int64_t qh, const void *kc, const void *vc, int64_t cb,
                    int64_t ch, int64_t ct, const int32_t *bt, int64_t bts, const int32_t *sl, float *out,
                    int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t block_size, int32_t d,
                    int32_t dtype, float scale, int32_t partition_tokens, int32_t threads) {
    AttnArgs a{query, qs, qh, kc, vc, cb, ch, ct, bt, bts, sl, out,
               num_seqs, num_heads, num_kv_heads, block_size, d, num_heads / num_kv_heads, scale};
    try {
        if (dtype == HAL_F16) return paged_attention_t<F16>(a, partition_tokens, threads);
        if (dtype == HAL_BF16) return paged_attention_t<BF16>(a, partition_tokens, threads);
        return paged_attention_t<F32>(a, partition_tokens, threads);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}

// ---------------------------------------------------------------------------------------------
// activations to float32
// ---------------------------------------------------------------------------------------------

template <class S>
inline void row_to_f32(const typename S::T *x, int64_t k, float *out) {
    int64_t c = 0;
    for (; c + W <= k; c += W) V::store(out + c, vload<S>(x + c));
    for (; c < k; ++c) out[c] = S::scalar(x + c);
}

inline void any_row_to_f32(const void *x, int32_t dtype, int64_t k, float *out) {
    if (dtype == HAL_F16) row_to_f32<F16>(static_cast<const uint16_t *>(x), k, out);
    else if (dtype == HAL_BF16) row_to_f32<BF16>(static_cast<const uint16_t *>(x), k, out);
    else row_to_f32<F32>(static_cast<const float *>(x), k, out);
}

inline const void *row_ptr(const void *x, int32_t dtype, int64_t row, int64_t stride) {
    return static_cast<const char *>(x) + row * stride * (dtype == HAL_F32 ? 4 : 2);
}

int to_float32(const void *x, int32_t dtype, int64_t stride, int64_t m, int64_t k, float *out, int32_t threads) {
    parallel_for(m, threads, [&](int64_t r) { any_row_to_f32(row_ptr(x, dtype, r, stride), dtype, k, out + r * k); });
    return HAL_OK;
}

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
            const float *xr = xs + 8 * r;
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
        for (int v = 0; v < NV; ++v) {
            const int64_t col = g * n + n0 + v * W;
            const V::f s = vload<SS>(scales + col);
            const V::f z = zeros ? V::load_u8(zeros + col) : V::set1(zdef);
            for (int mb = 0; mb < MB; ++mb)
                tot[mb][v] = V::fma(s, V::fnma(z, V::set1(xsum[mb * ngroups + g]), acc[mb][v]), tot[mb][v]);
        }
    }
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) V::store(y + mb * ldy + n0 + v * W, tot[mb][v]);
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

template <class SS>
int w4a16_t(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, int64_t n, const uint32_t *qw,
            const void *scales_v, const uint8_t *zeros, int32_t zdef, int64_t gsize, float *y, int64_t n_tile,
            int32_t threads) {
    const auto *scales = static_cast<const typename SS::T *>(scales_v);
    const int64_t ngroups = k / gsize;
    // Bounded by the activations: the codes' pre-scaled copy of x and its group sums.
    std::vector<float> x32(size_t(m) * k), xs(size_t(m) * k), xsum(size_t(m) * ngroups);
    parallel_for(m, threads, [&](int64_t r) {
        float *xr = x32.data() + r * k;
        any_row_to_f32(row_ptr(x, xdt, r, xstride), xdt, k, xr);
        for (int64_t g = 0; g < ngroups; ++g) {
            float s = 0.0f;
            for (int64_t kk = g * gsize; kk < (g + 1) * gsize; ++kk) s += xr[kk];
            xsum[r * ngroups + g] = s;
        }
        for (int64_t kk = 0; kk < k; ++kk) xs[r * k + kk] = xr[kk] * kNibbleScale[kk % 8];
    });
    const bool gemv = m <= 2;
    const int64_t nv = gemv ? 4 : 2;
    int64_t tile = std::max<int64_t>(n_tile, nv * W) / (nv * W) * (nv * W);
    const int64_t full = n / (nv * W) * (nv * W);
    const int64_t ntiles = (full + tile - 1) / tile;
    parallel_for(ntiles, threads, [&](int64_t t) {
        const int64_t c1 = std::min(full, (t + 1) * tile);
        for (int64_t c = t * tile; c < c1; c += nv * W) {
            if (gemv) w4_rows<SS, 4>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c, scales, zeros, float(zdef), gsize, y);
            else w4_rows<SS, 2>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c, scales, zeros, float(zdef), gsize, y);
        }
    });
    int64_t c = full;
    for (; c + W <= n; c += W)
        w4_rows<SS, 1>(m, xs.data(), k, xsum.data(), ngroups, qw, n, c, scales, zeros, float(zdef), gsize, y);
    w4_scalar_cols<SS>(x32.data(), m, k, qw, n, c, n, scales, zeros, float(zdef), gsize, y);
    return HAL_OK;
}

int w4a16_gemv(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, int64_t n, const uint32_t *qw,
               const void *scales, int32_t sdt, const uint8_t *zeros, int32_t zdef, int64_t gsize, float *y,
               int64_t n_tile, int32_t threads) {
    try {
        if (sdt == HAL_F16) return w4a16_t<F16>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, gsize, y, n_tile, threads);
        if (sdt == HAL_BF16) return w4a16_t<BF16>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, gsize, y, n_tile, threads);
        return w4a16_t<F32>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, gsize, y, n_tile, threads);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantised tiles (fed to BLAS for large M, and for act-order int4 weights)
// ---------------------------------------------------------------------------------------------

template <class SS>
void dequant_t(const void *qweight, int32_t bits, const typename SS::T *scales, const uint8_t *zeros, int32_t zdef,
               const int32_t *g_idx, int64_t gsize, int64_t k, int64_t n, int64_t n0, int64_t n1, float *out,
               int64_t ld, int32_t threads) {
    const int64_t width = n1 - n0;
    const int64_t rows_per_task = 64;
    parallel_for((k + rows_per_task - 1) / rows_per_task, threads, [&](int64_t t) {
        const int64_t r1 = std::min(k, (t + 1) * rows_per_task);
        for (int64_t r = t * rows_per_task; r < r1; ++r) {
            const int64_t g = g_idx ? g_idx[r] : r / gsize;
            const typename SS::T *srow = scales + g * n + n0;
            const uint8_t *zrow = zeros ? zeros + g * n + n0 : nullptr;
            float *o = out + r * ld;
            const V::f zd = V::set1(float(zdef));
            int64_t c = 0;
            if (bits == 4) {
                const uint32_t *wrow = static_cast<const uint32_t *>(qweight) + (r / 8) * n + n0;
                const int shift = int(4 * (r % 8));
                const V::i mask = V::seti(0xFu);
                for (; c + W <= width; c += W) {
                    V::i w = V::loadi(wrow + c);
                    V::i q;
                    switch (shift) {  // immediate shifts
                        case 0: q = w; break;
                        case 4: q = V::srli<4>(w); break;
                        case 8: q = V::srli<8>(w); break;
                        case 12: q = V::srli<12>(w); break;
                        case 16: q = V::srli<16>(w); break;
                        case 20: q = V::srli<20>(w); break;
                        case 24: q = V::srli<24>(w); break;
                        default: q = V::srli<28>(w); break;
                    }
                    const V::f z = zrow ? V::load_u8(zrow + c) : zd;
                    V::store(o + c, V::mul(V::sub(V::cvt(V::andi(q, mask)), z), vload<SS>(srow + c)));
                }
                for (; c < width; ++c) {
                    const float q = float((wrow[c] >> shift) & 0xFu);
                    o[c] = (q - (zrow ? float(zrow[c]) : float(zdef))) * SS::scalar(srow + c);
                }
            } else {
                const uint8_t *wrow = static_cast<const uint8_t *>(qweight) + r * n + n0;
                for (; c + W <= width; c += W) {
                    const V::f z = zrow ? V::load_u8(zrow + c) : zd;
                    V::store(o + c, V::mul(V::sub(V::load_u8(wrow + c), z), vload<SS>(srow + c)));
                }
                for (; c < width; ++c)
                    o[c] = (float(wrow[c]) - (zrow ? float(zrow[c]) : float(zdef))) * SS::scalar(srow + c);
            }
        }
    });
}

int dequant_tile(const void *qweight, int32_t bits, const void *scales, int32_t sdt, const uint8_t *zeros,
                 int32_t zdef, const int32_t *g_idx, int64_t gsize, int64_t k, int64_t n, int64_t n0, int64_t n1,
                 float *out, int64_t ld, int32_t threads) {
    if (sdt == HAL_F16)
        dequant_t<F16>(qweight, bits, static_cast<const uint16_t *>(scales), zeros, zdef, g_idx, gsize, k, n, n0, n1, out, ld, threads);
    else if (sdt == HAL_BF16)
        dequant_t<BF16>(qweight, bits, static_cast<const uint16_t *>(scales), zeros, zdef, g_idx, gsize, k, n, n0, n1, out, ld, threads);
    else
        dequant_t<F32>(qweight, bits, static_cast<const float *>(scales), zeros, zdef, g_idx, gsize, k, n, n0, n1, out, ld, threads);
    return HAL_OK;
}

// ---------------------------------------------------------------------------------------------
// W8A8: per-token quantisation fused; exact integer sums per group
// ---------------------------------------------------------------------------------------------
//
// Codes and quantised activations are small integers, so their products and running sums are
// exact in fp32 while below 2**24: 127 * 255 * 512 < 2**24. Groups are therefore walked in
// segments of at most 512 rows; each segment's exact sum has its zero-point term subtracted
// (exact too) before the group scale is applied.

constexpr int64_t kExactRows = 512;

struct Segment { int64_t start, end; int32_t group; };

template <class SS, int MB, int NV>
inline void w8_tile(const float *xq, int64_t k, const float *xqsum, int64_t nseg, const Segment *segs,
                    const int32_t *perm, const uint8_t *qw, int64_t n, int64_t n0, const typename SS::T *scales,
                    const uint8_t *zeros, float zdef, float *y, int64_t ldy) {
    V::f tot[MB][NV];
    for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < NV; ++v) tot[mb][v] = V::zero();
    for (int64_t sgi = 0; sgi < nseg; ++sgi) {
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
inline void w8_rows(int64_t rows, const float *xq, int64_t k, const float *xqsum, int64_t nseg, const Segment *segs,
                    const int32_t *perm, const uint8_t *qw, int64_t n, int64_t n0, const typename SS::T *sc,
                    const uint8_t *zeros, float zdef, float *y) {
    constexpr int MB = NV >= 4 ? 1 : (W >= 16 ? 6 : 2);
    for (int64_t r = 0; r < rows;) {
        const int64_t left = std::min<int64_t>(MB, rows - r);
#define HAL_W8_ROWS(R) w8_tile<SS, R, NV>(xq + r * k, k, xqsum + r * nseg, nseg, segs, perm, qw, n, n0, sc, zeros, \
                                          zdef, y + r * n, n)
        if (left >= MB) HAL_W8_ROWS(MB);
        else if (MB > 4 && left >= 4) { HAL_W8_ROWS(4 <= MB ? 4 : 1); r += 4; continue; }
        else if (left >= 2) { HAL_W8_ROWS(2 <= MB ? 2 : 1); r += 2; continue; }
        else HAL_W8_ROWS(1);
#undef HAL_W8_ROWS
        r += left >= MB ? MB : 1;
    }
}

template <class SS>
int w8a8_t(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, int64_t n, const uint8_t *qw,
           const void *scales_v, const uint8_t *zeros, int32_t zdef, const int32_t *perm, const int64_t *starts,
           const int32_t *group_of_run, int64_t runs, float *y, int64_t n_tile, int32_t threads) {
    const auto *scales = static_cast<const typename SS::T *>(scales_v);
    std::vector<Segment> segs;
    for (int64_t r = 0; r < runs; ++r)
        for (int64_t s = starts[r]; s < starts[r + 1]; s += kExactRows)
            segs.push_back({s, std::min(starts[r + 1], s + kExactRows), group_of_run[r]});
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
    const int64_t nv = gemv ? 4 : 2;
    int64_t tile = std::max<int64_t>(n_tile, nv * W) / (nv * W) * (nv * W);
    const int64_t full = n / (nv * W) * (nv * W);
    const int64_t ntiles = (full + tile - 1) / tile;
    parallel_for(ntiles, threads, [&](int64_t t) {
        const int64_t c1 = std::min(full, (t + 1) * tile);
        for (int64_t c = t * tile; c < c1; c += nv * W) {
            if (gemv) w8_rows<SS, 4>(m, xq.data(), k, xqsum.data(), nseg, segs.data(), perm, qw, n, c, scales, zeros, float(zdef), y);
            else w8_rows<SS, 2>(m, xq.data(), k, xqsum.data(), nseg, segs.data(), perm, qw, n, c, scales, zeros, float(zdef), y);
        }
    });
    int64_t c = full;
    for (; c + W <= n; c += W)
        w8_rows<SS, 1>(m, xq.data(), k, xqsum.data(), nseg, segs.data(), perm, qw, n, c, scales, zeros, float(zdef), y);
    for (; c < n; ++c)
        for (int64_t r = 0; r < m; ++r) {
            float total = 0.0f;
            for (int64_t sgi = 0; sgi < nseg; ++sgi) {
                float acc = 0.0f;
                for (int64_t i = segs[sgi].start; i < segs[sgi].end; ++i)
                    acc += xq[r * k + i] * float(qw[(perm ? int64_t(perm[i]) : i) * n + c]);
                const int64_t col = int64_t(segs[sgi].group) * n + c;
                const float z = zeros ? float(zeros[col]) : float(zdef);
                total += SS::scalar(scales + col) * (acc - z * xqsum[r * nseg + sgi]);
            }
            y[r * n + c] = total;
        }
    parallel_for(m, threads, [&](int64_t r) {
        float *yr = y + r * n;
        const float s = bad[r] ? kNaN : sx[r];
        for (int64_t i = 0; i < n; ++i) yr[i] *= s;
    });
    return HAL_OK;
}

int w8a8_gemm(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, int64_t n, const uint8_t *qw,
              const void *scales, int32_t sdt, const uint8_t *zeros, int32_t zdef, const int32_t *perm,
              const int64_t *starts, const int32_t *group_of_run, int64_t runs, float *y, int64_t n_tile,
              int32_t threads) {
    try {
        if (sdt == HAL_F16)
            return w8a8_t<F16>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, perm, starts, group_of_run, runs, y, n_tile, threads);
        if (sdt == HAL_BF16)
            return w8a8_t<BF16>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, perm, starts, group_of_run, runs, y, n_tile, threads);
        return w8a8_t<F32>(x, xdt, xstride, m, k, n, qw, scales, zeros, zdef, perm, starts, group_of_run, runs, y, n_tile, threads);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}

const KernelTable table = {paged_attention, to_float32, w4a16_gemv, dequant_tile, w8a8_gemm};

}  // namespace HAL_ISA_NAME
}  // namespace hal

#define HAL_CONCAT2(a, b) a##b
#define HAL_CONCAT(a, b) HAL_CONCAT2(a, b)

extern "C" const hal::KernelTable *HAL_CONCAT(hal_kernels_, HAL_ISA_NAME)() { return &hal::HAL_ISA_NAME::table; }
