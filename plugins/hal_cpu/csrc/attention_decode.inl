// attention_decode.inl: included by paged_attention.inl after attention_shared.inl; not a standalone header.
// ---------------------------------------------------------------------------------------------
// paged_attention's decode tasks (one new token per sequence): a task covers one sequence, or one
// partition of its keys (split-KV), and every KV head. The register tiles of Q.K (qk_tile, and
// qk_tile_bf16 by vdpbf16ps) and of P.V (pv_tile), the online softmax step over a step's scores
// (softmax_step), the task (decode_task) and the log-sum-exp merge of a split sequence's partitions
// (decode_merge).
// ---------------------------------------------------------------------------------------------

// Software prefetch of one byte range into L2, spread over a phase's compute: a few lines per call of step().
// Issued as one burst per step the same prefetches filled the miss queues and stalled the very loads the compute
// needed; spread out, compute and memory overlap (measured on the read pattern with the kernel's FMA density:
// 27 vs 20 GB/s).
struct Prefetch {
    const char *p = nullptr, *end = nullptr;
    int per = 0;  // lines per step()
    // Spread what is left over `calls` steps.
    void plan(int64_t calls) {
        const int64_t lines = (end - p + 63) / 64;
        per = p < end ? int(std::max<int64_t>(1, (lines + calls - 1) / std::max<int64_t>(1, calls))) : 0;
    }
    void step() {
        for (int i = 0; i < per && p < end; ++i, p += 64) __builtin_prefetch(p, 0, 2);
    }
};

// sc[g * kChunk + n] = q_g . k_n for G query heads and N key rows: G * N accumulators in registers,
// each K vector loaded once for all G heads, each q vector once for all N rows, one joint reduction.
template <class S, int G, int N>
inline void qk_tile(const float *q, int d, const typename S::T *k, int64_t ct, float *sc, Prefetch &pf) {
    static_assert(G * N <= kAttnAcc, "the tile must fit the accumulators");
    V::f acc[kAttnAcc];
#pragma GCC unroll 16  // unrolled before loop distribution, or the zeroing becomes a memset of a stack copy
    for (int i = 0; i < kAttnAcc; ++i) acc[i] = V::zero();
    int c = 0;
    for (; c + W <= d; c += W) {
        pf.step();
        V::f qv[G];
        for (int g = 0; g < G; ++g) qv[g] = V::load(q + g * d + c);
        for (int n = 0; n < N; ++n) {
            const V::f kv = vload<S>(k + n * ct + c);
            for (int g = 0; g < G; ++g) acc[n * G + g] = V::fma(qv[g], kv, acc[n * G + g]);
        }
    }
    alignas(64) float sums[kAttnAcc];
    hsum_acc(acc, sums);
    for (int n = 0; n < N; ++n)
        for (int g = 0; g < G; ++g) {
            float s = sums[n * G + g];
            for (int e = c; e < d; ++e) s += q[g * d + e] * S::scalar(k + n * ct + e);
            sc[g * kChunk + n] = s;
        }
}

template <int G>
constexpr int qk_rows() { return G >= kAttnAcc ? 1 : kAttnAcc / G; }

template <class S, int G>
inline void qk_rows_all(const float *q, int d, const typename S::T *k, int64_t ct, int T, float *sc,
                        Prefetch &pf) {
    constexpr int N = qk_rows<G>();
    pf.plan(int64_t(T / N + T % N) * (d / W));
    int t = 0;
    for (; t + N <= T; t += N) qk_tile<S, G, N>(q, d, k + t * ct, ct, sc + t, pf);
    for (; t < T; ++t) qk_tile<S, G, 1>(q, d, k + t * ct, ct, sc + t, pf);
}

// Columns [c, c + CB * W) of acc[g] = alpha[g] * acc[g] + sum_t p[g][t] * v_t, held in registers over the T rows.
template <class S, int G, int CB>
inline void pv_tile(float *acc, const float *alpha, int d, int c, const float *p, int T, const typename S::T *v,
                    int64_t ct, Prefetch &pf) {
    V::f a[G][CB];
    for (int g = 0; g < G; ++g) {
        const V::f al = V::set1(alpha[g]);
        for (int b = 0; b < CB; ++b) a[g][b] = V::mul(V::load(acc + g * d + c + b * W), al);
    }
    for (int t = 0; t < T; ++t) {
        pf.step();
        V::f pv[G];
        for (int g = 0; g < G; ++g) pv[g] = V::set1(p[g * kChunk + t]);
        for (int b = 0; b < CB; ++b) {
            const V::f vv = vload<S>(v + t * ct + c + b * W);
            for (int g = 0; g < G; ++g) a[g][b] = V::fma(pv[g], vv, a[g][b]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int b = 0; b < CB; ++b) V::store(acc + g * d + c + b * W, a[g][b]);
}

template <int G>
constexpr int pv_cols() { return G >= kAttnAcc ? 1 : (kAttnAcc / G < 8 ? kAttnAcc / G : 8); }

template <class S, int G>
inline void pv_rows_all(float *acc, const float *alpha, int d, const float *p, int T, const typename S::T *v,
                        int64_t ct, Prefetch &pf) {
    constexpr int CB = pv_cols<G>();
    pf.plan(int64_t(d / (CB * W) + d % (CB * W) / W) * T);
    int c = 0;
    for (; c + CB * W <= d; c += CB * W) pv_tile<S, G, CB>(acc, alpha, d, c, p, T, v, ct, pf);
    for (; c + W <= d; c += W) pv_tile<S, G, 1>(acc, alpha, d, c, p, T, v, ct, pf);
    for (; c < d; ++c)
        for (int g = 0; g < G; ++g) {
            float s = acc[g * d + c] * alpha[g];
            for (int t = 0; t < T; ++t) s += p[g * kChunk + t] * S::scalar(v + t * ct + c);
            acc[g * d + c] = s;
        }
}

#if defined(HAL_ISA_AVX512)
// bf16 scores by AVX512_BF16: vdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32, so one
// instruction does the work of two FMAs and K needs no widening. The query is read raw (bf16, unscaled:
// rounding the scaled query to bf16 would lose precision); the scale multiplies the finished dot product.
template <int G, int N>
__attribute__((target("avx512bf16"))) inline void qk_tile_bf16(const uint16_t *q, int64_t qh, int d,
                                                               const uint16_t *k, int64_t ct, float scale,
                                                               float *sc, Prefetch &pf) {
    static_assert(G * N <= kAttnAcc, "the tile must fit the accumulators");
    V::f acc[kAttnAcc];
#pragma GCC unroll 16
    for (int i = 0; i < kAttnAcc; ++i) acc[i] = V::zero();
    for (int c = 0; c < d; c += 32) {
        pf.step();
        __m512bh qv[G];
        for (int g = 0; g < G; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(q + g * qh + c);
        for (int n = 0; n < N; ++n) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + n * ct + c);
            for (int g = 0; g < G; ++g) acc[n * G + g] = _mm512_dpbf16_ps(acc[n * G + g], qv[g], kv);
        }
    }
    alignas(64) float sums[kAttnAcc];
    hsum_acc(acc, sums);
    for (int n = 0; n < N; ++n)
        for (int g = 0; g < G; ++g) sc[g * kChunk + n] = sums[n * G + g] * scale;
}

template <int G>
__attribute__((target("avx512bf16"), noinline)) void qk_rows_bf16(const uint16_t *q, int64_t qh, int d,
                                                                  const uint16_t *k, int64_t ct, int T,
                                                                  float scale, float *sc, Prefetch &pf) {
    constexpr int N = qk_rows<G>();
    pf.plan(int64_t(T / N + T % N) * (d / 32));
    int t = 0;
    for (; t + N <= T; t += N) qk_tile_bf16<G, N>(q, qh, d, k + t * ct, ct, scale, sc + t, pf);
    for (; t < T; ++t) qk_tile_bf16<G, 1>(q, qh, d, k + t * ct, ct, scale, sc + t, pf);
}

inline void qk_heads_bf16(int gq, const uint16_t *q, int64_t qh, int d, const uint16_t *k, int64_t ct, int T,
                          float scale, float *sc, Prefetch &pf) {
    for (int g0 = 0; g0 < gq; g0 += 8) {
        const uint16_t *qg = q + int64_t(g0) * qh;
        float *sg = sc + int64_t(g0) * kChunk;
        switch (std::min(8, gq - g0)) {
            case 1: qk_rows_bf16<1>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 2: qk_rows_bf16<2>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 3: qk_rows_bf16<3>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 4: qk_rows_bf16<4>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 5: qk_rows_bf16<5>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 6: qk_rows_bf16<6>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            case 7: qk_rows_bf16<7>(qg, qh, d, k, ct, T, scale, sg, pf); break;
            default: qk_rows_bf16<8>(qg, qh, d, k, ct, T, scale, sg, pf); break;
        }
    }
}

inline bool cpu_has_bf16_dot() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has;
}
#else
inline bool cpu_has_bf16_dot() { return false; }
#endif

// Groups of up to 8 query heads share each loaded row: the scores (scores = true) or P @ V.
template <class S>
inline void for_heads(int gq, const float *q, float *acc, const float *alpha, float *sc, int d, int T,
                      const typename S::T *kv, int64_t ct, bool scores, Prefetch &pf) {
    for (int g0 = 0; g0 < gq; g0 += 8) {
        const float *qg = q + int64_t(g0) * d;
        float *ag = acc + int64_t(g0) * d;
        float *sg = sc + int64_t(g0) * kChunk;
        const float *al = alpha + g0;
#define HAL_HEADS_CASE(G)                                         \
    case G:                                                       \
        if (scores) qk_rows_all<S, G>(qg, d, kv, ct, T, sg, pf);  \
        else pv_rows_all<S, G>(ag, al, d, sg, T, kv, ct, pf);     \
        break;
        switch (std::min(8, gq - g0)) {
            HAL_HEADS_CASE(1)
            HAL_HEADS_CASE(2)
            HAL_HEADS_CASE(3)
            HAL_HEADS_CASE(4)
            HAL_HEADS_CASE(5)
            HAL_HEADS_CASE(6)
            HAL_HEADS_CASE(7)
            default: HAL_HEADS_CASE(8)
        }
#undef HAL_HEADS_CASE
    }
}

alignas(64) constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The online softmax step of a head group's gq heads (query heads h0..) over the step's scores
// sc[g * kChunk + [0, T)] of keys t0.. for a query at position p: softcap and ALiBi applied, the scores become
// probabilities, alpha[g] the rescale of head g's accumulator, m/l advance (a NaN score makes l NaN).
// scratch holds 2 * round_up(gq, W) floats.
inline void softmax_step(const AttnCtx &c, float *sc, int T, int h0, int64_t t0, int64_t p, float *m, float *l,
                         float *alpha, float *scratch) {
    const int gq = c.gq, padded = (T + W - 1) / W * W, gp = (gq + W - 1) / W * W;
    const bool mod = c.a->softcap > 0.0f || c.a->alibi_slopes;
    float *mold = scratch, *ms = scratch + gp;
    for (int g = 0; g < gq; ++g) {
        float *sg = sc + g * kChunk;
        if (mod) {
            const V::f slope = V::set1(c.slope(h0 + g));
            for (int i = 0; i < T; i += W) {
                const V::f rel = V::add(V::set1(float(t0 + i - p)), V::load(kIota));
                V::store(sg + i, mod_scores(V::load(sg + i), c.a->softcap, rel, slope));
            }
        }
        for (int i = T; i < padded; ++i) sg[i] = -kInf;
        V::f vm = V::set1(-kInf);
        for (int i = 0; i < padded; i += W) vm = vmax(V::load(sg + i), vm);  // NaN lanes ignored here
        const float mnew = std::max(m[g], hmax(vm));
        mold[g] = m[g];
        ms[g] = std::isfinite(mnew) ? mnew : 0.0f;  // -inf so far: every p is exp(-inf) = 0
        m[g] = mnew;
    }
    for (int g = gq; g < gp; ++g) mold[g] = ms[g] = 0.0f;
    // exp(-inf - ms) = 0: a head with no finite score yet has nothing to rescale.
    for (int g = 0; g < gp; g += W) V::store(alpha + g, V::exp(V::sub(V::load(mold + g), V::load(ms + g))));
    for (int g = 0; g < gq; ++g) {
        float *sg = sc + g * kChunk;
        V::f sum = V::zero();
        const V::f vms = V::set1(ms[g]);
        for (int i = 0; i < padded; i += W) {
            const V::f pr = V::exp(V::sub(V::load(sg + i), vms));
            V::store(sg + i, pr);
            sum = V::add(sum, pr);
        }
        l[g] = l[g] * alpha[g] + V::hsum(sum);  // exp keeps a NaN score NaN, and so does the sum
    }
}

// Keys [t0, t1) of decode sequence s, every KV head: online softmax in fp32. Writes either the output rows
// (part == nullptr) or, per query head, (max, denominator, acc[d]) to part.
template <class S>
void decode_task(const AttnCtx &c, int s, int64_t t0, int64_t t1, float *part) {
    using T = typename S::T;
    const hal_cpu_attention_args &a = *c.a;
    const int H = a.num_heads, KV = a.num_kv_heads, gq = c.gq, d = a.head_size;
    const int64_t row = c.row0(s), p = a.seq_lens[s] - 1;
    // q and acc per query head, one head group's scores, alpha and softmax scratch (gq rounded up to W),
    // (m, l) per query head, one output row.
    const size_t gp = size_t(gq + W - 1) / W * W;
    std::vector<float> buf(size_t(H) * (2 * d + 2) + size_t(gq) * kChunk + 3 * gp + size_t(d));
    float *q = buf.data(), *acc = q + size_t(H) * d, *sc = acc + size_t(H) * d;
    float *alpha = sc + size_t(gq) * kChunk, *scratch = alpha + gp, *m = scratch + 2 * gp, *l = m + H;
    float *tmp = l + H;
    const T *query = static_cast<const T *>(a.query) + row * a.q_token_stride;
    const V::f vscale = V::set1(a.scale);
    for (int h = 0; h < H; ++h) {
        const T *qrow = query + int64_t(h) * a.q_head_stride;
        float *qh = q + int64_t(h) * d;
        int e = 0;
        for (; e + W <= d; e += W) V::store(qh + e, V::mul(vload<S>(qrow + e), vscale));
        for (; e < d; ++e) qh[e] = S::scalar(qrow + e) * a.scale;
        m[h] = -kInf;
        l[h] = 0.0f;
    }
    std::fill(acc, acc + size_t(H) * d, 0.0f);
    const T *kc = static_cast<const T *>(a.key_cache), *vc = static_cast<const T *>(a.value_cache);
    const int bs = a.block_size;
    const int64_t block_bytes = 2 * int64_t(KV) * bs * d * int64_t(sizeof(T));
    const int64_t ahead = std::max<int64_t>(1, kLookaheadBytes / std::max<int64_t>(1, block_bytes));  // blocks
    const int32_t *table = a.block_tables + s * a.bt_stride;
    for (int64_t t = t0; t < t1;) {
        const int64_t j = t / bs, off = t % bs;
        const int T_ = int(std::min<int64_t>({int64_t(bs) - off, t1 - t, int64_t(kChunk)}));
        const int64_t kbase = int64_t(table[j]) * a.k_block_stride + off * a.k_token_stride;
        const int64_t vbase = int64_t(table[j]) * a.v_block_stride + off * a.v_token_stride;
        // Blocks are scattered: each head's step prefetches the same rows `ahead` blocks later, so the
        // prefetches spread evenly over the blocks (and, inside a step, over its tiles: Prefetch).
        const int64_t tp = t + ahead * bs;
        const int Tp = int(std::min<int64_t>(T_, t1 - tp));
        const int64_t pblock = Tp > 0 ? int64_t(table[j + ahead]) : 0;
        for (int kvh = 0; kvh < KV; ++kvh) {
            const int h0 = kvh * gq;
            const T *k = kc + kbase + kvh * a.k_head_stride, *v = vc + vbase + kvh * a.v_head_stride;
            // The same rows `ahead` blocks later, K during the scores and V during P @ V.
            Prefetch pk, pv;
            if (Tp > 0) {
                pk.p = reinterpret_cast<const char *>(kc + pblock * a.k_block_stride + off * a.k_token_stride +
                                                      kvh * a.k_head_stride);
                pv.p = reinterpret_cast<const char *>(vc + pblock * a.v_block_stride + off * a.v_token_stride +
                                                      kvh * a.v_head_stride);
                pk.end = pk.p + (int64_t(Tp - 1) * a.k_token_stride + d) * int64_t(sizeof(T));
                pv.end = pv.p + (int64_t(Tp - 1) * a.v_token_stride + d) * int64_t(sizeof(T));
            }
            float *qk = q + int64_t(h0) * d, *ak = acc + int64_t(h0) * d;
            bool scored = false;
#if defined(HAL_ISA_AVX512)
            if constexpr (std::is_same<S, BF16>::value) {
                if (c.bf16_dot) {
                    qk_heads_bf16(gq, query + int64_t(h0) * a.q_head_stride, a.q_head_stride, d, k, a.k_token_stride,
                                  T_, a.scale, sc, pk);
                    scored = true;
                }
            }
#endif
            if (!scored) for_heads<S>(gq, qk, ak, alpha, sc, d, T_, k, a.k_token_stride, true, pk);
            softmax_step(c, sc, T_, h0, t, p, m + h0, l + h0, alpha, scratch);
            for_heads<S>(gq, qk, ak, alpha, sc, d, T_, v, a.v_token_stride, false, pv);
        }
        t += T_;
    }
    for (int h = 0; h < H; ++h) {
        const float *ah = acc + int64_t(h) * d;
        if (!part) {
            finish_row(m[h], l[h], ah, c.sink(h), d, out_row(a, row, h), a.out_dtype, tmp);
        } else {
            float *pp = part + int64_t(h) * (d + 2);
            pp[0] = m[h];
            pp[1] = l[h];
            std::memcpy(pp + 2, ah, sizeof(float) * d);
        }
    }
}

// Log-sum-exp merge of a decode sequence's partitions for one KV head's query heads, then the sink and the
// normalisation (finish_row).
inline void decode_merge(const AttnCtx &c, int s, int kvh, const float *parts, int nparts) {
    const hal_cpu_attention_args &a = *c.a;
    const int gq = c.gq, d = a.head_size;
    const int64_t pstride = int64_t(a.num_heads) * (d + 2);
    std::vector<float> acc(size_t(2 * d));
    for (int g = 0; g < gq; ++g) {
        const int h = kvh * gq + g;
        float top = -kInf;
        bool nan = false;
        for (int p = 0; p < nparts; ++p) {
            const float mp = parts[p * pstride + h * (d + 2)];
            nan |= mp != mp;
            top = std::max(top, mp);
        }
        if (nan) top = kNaN;
        std::fill(acc.begin(), acc.begin() + d, 0.0f);
        float denom = 0.0f;
        for (int p = 0; p < nparts; ++p) {
            const float *pp = parts + p * pstride + h * (d + 2);
            const float w = pp[0] == -kInf ? 0.0f : std::exp(pp[0] - top);
            denom += w * pp[1];
            for (int e = 0; e < d; ++e) acc[e] += w * pp[2 + e];
        }
        finish_row(top, denom, acc.data(), c.sink(h), d, out_row(a, c.row0(s), h), a.out_dtype, acc.data() + d);
    }
}
