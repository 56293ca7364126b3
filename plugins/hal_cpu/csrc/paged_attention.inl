// paged_attention.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
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
