// attention_prefill.inl: included by paged_attention.inl after attention_shared.inl; not a standalone header.
// ---------------------------------------------------------------------------------------------
// paged_attention's prefill tasks (several new tokens: prompts, prompt chunks): a task owns one KV head
// and a tile of query tokens. K and V widened to float32 rows once per key tile (widen_rows), the
// register tiles of S^T = K Q^T (qk_block) and of O = alpha O + P V (pv_block), the lane-wise online
// softmax with the causal/window mask (prefill_softmax) and the task (prefill_task). The AMX variant of
// the task is attention_amx.inl.
// ---------------------------------------------------------------------------------------------

// What a prefill task keeps between key tiles. Rows are (token, GQA head), token-major; mp = rows rounded up
// to W (the padding rows are zero queries at the last row's position, never written out).
struct PrefillTile {
    int rows, mp, d;
    float *qt;     // [d][mp]: the scaled queries, transposed (a row per lane)
    float *o;      // [rows][d]: the unnormalised output
    float *st;     // [kKeyTile][mp]: S^T, then P^T
    float *kp;     // [kKeyTile][d]: K widened
    float *vp;     // [kKeyTile][d]: V widened
    float *pos;    // [mp]: each row's position
    float *slope;  // [mp]: each row's ALiBi slope (0: none)
    float *m;      // [mp]: running max
    float *l;      // [mp]: running denominator
    float *alpha;  // [mp]: this key tile's rescale of o
};

// Rows [t0, t0 + n) of one KV head of a paged cache, widened to float32 rows of d (dst[n][d]); the rows of the next
// tile (up to `ahead` of them, kKeyTile on) are prefetched into L2 meanwhile. Returns whether any value is not finite.
template <class S>
inline bool widen_rows(const typename S::T *cache, int64_t bstride, int64_t tstride, const int32_t *table, int bs,
                       int64_t t0, int n, int ahead, int d, float *dst) {
    V::f probe = V::zero();
    bool bad = false;
    for (int r = 0; r < n; ++r) {
        const int64_t t = t0 + r;
        const typename S::T *src = cache + int64_t(table[t / bs]) * bstride + (t % bs) * tstride;
        if (r < ahead) {
            const int64_t tn = t + kKeyTile;
            const char *p = reinterpret_cast<const char *>(cache + int64_t(table[tn / bs]) * bstride + (tn % bs) * tstride);
            for (int64_t b = 0; b < int64_t(d) * int64_t(sizeof(typename S::T)); b += 64) __builtin_prefetch(p + b, 0, 2);
        }
        float *o = dst + int64_t(r) * d;
        int e = 0;
        for (; e + W <= d; e += W) {
            const V::f x = vload<S>(src + e);
            probe = V::add(probe, V::mul(x, V::zero()));  // 0 * inf and 0 * NaN are NaN
            V::store(o + e, x);
        }
        for (; e < d; ++e) {
            o[e] = S::scalar(src + e);
            bad |= !std::isfinite(o[e]);
        }
    }
    const float sum = V::hsum(probe);
    return bad || sum != sum;
}

// st[k][j * W + lane] = sum_e kp[k][e] * qt[e][j * W + lane] for NK keys and MV vectors of query rows.
template <int NK, int MV>
inline void qk_block(const float *kp, int d, const float *qt, int mp, float *st) {
    V::f acc[NK][MV];
    for (int k = 0; k < NK; ++k)
        for (int j = 0; j < MV; ++j) acc[k][j] = V::zero();
    for (int e = 0; e < d; ++e) {
        V::f q[MV];
        for (int j = 0; j < MV; ++j) q[j] = V::load(qt + int64_t(e) * mp + j * W);
        for (int k = 0; k < NK; ++k) {
            const V::f kb = V::set1(kp[int64_t(k) * d + e]);
            for (int j = 0; j < MV; ++j) acc[k][j] = V::fma(kb, q[j], acc[k][j]);
        }
    }
    for (int k = 0; k < NK; ++k)
        for (int j = 0; j < MV; ++j) V::store(st + int64_t(k) * mp + j * W, acc[k][j]);
}

template <int MV>
inline void qk_keys(const PrefillTile &t, int nk, int m0) {
    int k = 0;
    for (; k + kQkKeys <= nk; k += kQkKeys)
        qk_block<kQkKeys, MV>(t.kp + int64_t(k) * t.d, t.d, t.qt + m0, t.mp, t.st + int64_t(k) * t.mp + m0);
    for (; k < nk; ++k) qk_block<1, MV>(t.kp + int64_t(k) * t.d, t.d, t.qt + m0, t.mp, t.st + int64_t(k) * t.mp + m0);
}

// S^T = K Q^T for the tile's nk keys and every query row.
inline void prefill_scores(const PrefillTile &t, int nk) {
    int m0 = 0;
    for (; m0 + kQkRowVecs * W <= t.mp; m0 += kQkRowVecs * W) qk_keys<kQkRowVecs>(t, nk, m0);
    for (; m0 < t.mp; m0 += W) qk_keys<1>(t, nk, m0);
}

#if defined(HAL_ISA_AVX512)
// x rounded to the nearest bf16 (even on ties), as float32; x is finite or +/-inf here (exp of a score).
inline V::f round_bf16(V::f x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(0xffff), r));
}
#endif

// The online softmax of the tile's nk keys (positions k0..), lane-wise over the query rows: scores times
// score_scale, softcap, ALiBi and (when `masked`) the causal/window mask applied; S^T becomes P^T (each p rounded
// to bf16 when round_p, so that l sums what a bf16 product of P uses), alpha the rescale of o.
inline void prefill_softmax(const PrefillTile &t, const hal_cpu_attention_args &a, int nk, int64_t k0, bool masked,
                            float score_scale, bool round_p) {
    const bool mod = a.softcap > 0.0f || a.alibi_slopes;
    const V::f ninf = V::set1(-kInf), big = V::set1(std::numeric_limits<float>::max()), zero = V::zero();
    const V::f nwin = V::set1(-float(a.window));
    for (int m0 = 0; m0 < t.mp; m0 += W) {
        const V::f pos = V::load(t.pos + m0), slope = V::load(t.slope + m0), mold = V::load(t.m + m0);
        V::f mx = mold;
        for (int n = 0; n < nk; ++n) {
            float *sp = t.st + int64_t(n) * t.mp + m0;
            V::f x = V::mul(V::load(sp), V::set1(score_scale));
            {
                const V::f rel = V::sub(V::set1(float(k0 + n)), pos);  // t - p, exact below 2**24
                if (mod) x = mod_scores(x, a.softcap, rel, slope);
                if (masked) {
                    x = V::select_le(rel, zero, x, ninf);
                    if (a.window > 0) x = V::select_le(rel, nwin, ninf, x);
                }
            }
            V::store(sp, x);
            mx = vmax(x, mx);  // NaN lanes ignored here; they make l NaN below
        }
        const V::f ms = V::select_le(V::abs(mx), big, mx, zero);  // not finite (-inf so far): 0
        const V::f al = V::exp(V::sub(mold, ms));
        V::f sum = V::zero();
        for (int n = 0; n < nk; ++n) {
            float *sp = t.st + int64_t(n) * t.mp + m0;
            V::f pr = V::exp(V::sub(V::load(sp), ms));
#if defined(HAL_ISA_AVX512)
            if (round_p) pr = round_bf16(pr);
#endif
            V::store(sp, pr);
            sum = V::add(sum, pr);
        }
        (void)round_p;
        V::store(t.l + m0, V::fma(V::load(t.l + m0), al, sum));
        V::store(t.m + m0, mx);
        V::store(t.alpha + m0, al);
    }
}

// Rows [m0, m0 + R) x columns [c, c + CV * W) of o = alpha o + P V over the tile's nk keys.
template <int R, int CV>
inline void pv_block(const PrefillTile &t, int nk, int m0, int c) {
    V::f acc[R][CV];
    for (int r = 0; r < R; ++r) {
        const V::f al = V::set1(t.alpha[m0 + r]);
        for (int b = 0; b < CV; ++b) acc[r][b] = V::mul(V::load(t.o + int64_t(m0 + r) * t.d + c + b * W), al);
    }
    const float *pt = t.st + m0;
    for (int n = 0; n < nk; ++n) {
        V::f vv[CV];
        for (int b = 0; b < CV; ++b) vv[b] = V::load(t.vp + int64_t(n) * t.d + c + b * W);
        for (int r = 0; r < R; ++r) {
            const V::f pb = V::set1(pt[int64_t(n) * t.mp + r]);
            for (int b = 0; b < CV; ++b) acc[r][b] = V::fma(pb, vv[b], acc[r][b]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < CV; ++b) V::store(t.o + int64_t(m0 + r) * t.d + c + b * W, acc[r][b]);
}

template <int R>
inline void pv_cols_all(const PrefillTile &t, int nk, int m0) {
    int c = 0;
    for (; c + kPvVecs * W <= t.d; c += kPvVecs * W) pv_block<R, kPvVecs>(t, nk, m0, c);
    for (; c + W <= t.d; c += W) pv_block<R, 1>(t, nk, m0, c);
    for (; c < t.d; ++c)
        for (int r = 0; r < R; ++r) {
            float s = t.o[int64_t(m0 + r) * t.d + c] * t.alpha[m0 + r];
            for (int n = 0; n < nk; ++n) s += t.st[int64_t(n) * t.mp + m0 + r] * t.vp[int64_t(n) * t.d + c];
            t.o[int64_t(m0 + r) * t.d + c] = s;
        }
}

// o = alpha o + P V for every row.
inline void prefill_values(const PrefillTile &t, int nk) {
    int m0 = 0;
    for (; m0 + kPvRows <= t.rows; m0 += kPvRows) pv_cols_all<kPvRows>(t, nk, m0);
    switch (t.rows - m0) {
        case 1: pv_cols_all<1>(t, nk, m0); break;
        case 2: pv_cols_all<2>(t, nk, m0); break;
        case 3: pv_cols_all<3>(t, nk, m0); break;
        case 4: pv_cols_all<4>(t, nk, m0); break;
        case 5: pv_cols_all<5>(t, nk, m0); break;
        default: break;
    }
}

// o = alpha o + P V where a masked key must not reach a row even as 0 * v (the tile's V holds an Inf or NaN that
// a row may not see): each row sums over its visible keys only.
inline void prefill_values_visible(const PrefillTile &t, const hal_cpu_attention_args &a, int nk, int64_t k0) {
    for (int r = 0; r < t.rows; ++r) {
        float *o = t.o + int64_t(r) * t.d;
        for (int e = 0; e < t.d; ++e) o[e] *= t.alpha[r];
        for (int n = 0; n < nk; ++n) {
            const float rel = float(k0 + n) - t.pos[r];
            if (rel > 0.0f || (a.window > 0 && rel <= -float(a.window))) continue;
            const float p = t.st[int64_t(n) * t.mp + r];
            for (int e = 0; e < t.d; ++e) o[e] += p * t.vp[int64_t(n) * t.d + e];
        }
    }
}

// The positions [p_lo, p_hi] of a prefill task's tokens and the keys [k_begin, k_end) some row of it sees.
struct PrefillRange {
    int64_t p_lo, p_hi, k_begin, k_end;
    // Whether some row does not see some key of [k0, k0 + nk): the causal edge, or the window's far edge.
    bool masked(int64_t k0, int nk, int32_t window) const {
        return k0 + nk - 1 > p_lo || (window > 0 && k0 <= p_hi - window);
    }
};

// The rows of the task of tokens [i0, i1) (among sequence s's new tokens) and KV head kvh: positions, ALiBi slopes
// and an empty softmax state (padding rows take the last row's position); returns the task's key range.
inline PrefillRange prefill_rows(const AttnCtx &c, const PrefillTile &t, int s, int kvh, int i0, int i1) {
    const hal_cpu_attention_args &a = *c.a;
    const int64_t first = a.seq_lens[s] - c.q_len(s);
    for (int r = 0; r < t.mp; ++r) {
        t.pos[r] = float(first + i0 + std::min(r, t.rows - 1) / c.gq);
        t.slope[r] = r < t.rows ? c.slope(kvh * c.gq + r % c.gq) : 0.0f;
        t.m[r] = -kInf;
        t.l[r] = 0.0f;
    }
    const int64_t p_lo = first + i0, p_hi = first + i1 - 1;
    return {p_lo, p_hi, a.window > 0 ? std::max<int64_t>(0, p_lo - a.window + 1) : 0, p_hi + 1};
}

// The task's output rows from its softmax state, the sinks joining the normalisation; tmp holds d floats.
inline void prefill_finish(const AttnCtx &c, const PrefillTile &t, int s, int kvh, int i0, float *tmp) {
    const hal_cpu_attention_args &a = *c.a;
    for (int r = 0; r < t.rows; ++r) {
        const int h = kvh * c.gq + r % c.gq;
        finish_row(t.m[r], t.l[r], t.o + int64_t(r) * t.d, c.sink(h), t.d, out_row(a, c.row0(s) + i0 + r / c.gq, h),
                   a.out_dtype, tmp);
    }
}

// Tokens [i0, i1) (among sequence s's new tokens) of KV head kvh's query heads.
template <class S>
void prefill_task(const AttnCtx &c, int s, int kvh, int i0, int i1) {
    using T = typename S::T;
    const hal_cpu_attention_args &a = *c.a;
    const int gq = c.gq, d = a.head_size;
    const int64_t row0 = c.row0(s);
    PrefillTile t;
    t.rows = (i1 - i0) * gq;
    t.mp = (t.rows + W - 1) / W * W;
    t.d = d;
    std::vector<float> buf(size_t(d) * t.mp + size_t(t.rows) * d + size_t(kKeyTile) * (t.mp + 2 * d) + 6 * size_t(t.mp) +
                           size_t(d));
    t.qt = buf.data();
    t.o = t.qt + size_t(d) * t.mp;
    t.st = t.o + size_t(t.rows) * d;
    t.kp = t.st + size_t(kKeyTile) * t.mp;
    t.vp = t.kp + size_t(kKeyTile) * d;
    t.pos = t.vp + size_t(kKeyTile) * d;
    t.slope = t.pos + t.mp;
    t.m = t.slope + t.mp;
    t.l = t.m + t.mp;
    t.alpha = t.l + t.mp;
    float *tmp = t.alpha + t.mp;  // [d + mp]: one output row
    const T *query = static_cast<const T *>(a.query);
    for (int r = 0; r < t.mp; ++r) {
        const int i = i0 + std::min(r, t.rows - 1) / gq, h = kvh * gq + r % gq;
        const T *q = query + (row0 + i) * a.q_token_stride + int64_t(h) * a.q_head_stride;
        for (int e = 0; e < d; ++e) t.qt[int64_t(e) * t.mp + r] = r < t.rows ? S::scalar(q + e) * a.scale : 0.0f;
    }
    std::fill(t.o, t.o + size_t(t.rows) * d, 0.0f);
    const PrefillRange range = prefill_rows(c, t, s, kvh, i0, i1);
    const int64_t k_end = range.k_end;
    const int32_t *table = a.block_tables + s * a.bt_stride;
    const T *kc = static_cast<const T *>(a.key_cache) + kvh * a.k_head_stride;
    const T *vc = static_cast<const T *>(a.value_cache) + kvh * a.v_head_stride;
    for (int64_t k0 = range.k_begin; k0 < k_end; k0 += kKeyTile) {
        const int nk = int(std::min<int64_t>(kKeyTile, k_end - k0));
        const bool masked = range.masked(k0, nk, a.window);
        const int ahead = int(std::min<int64_t>(nk, k_end - (k0 + nk)));
        widen_rows<S>(kc, a.k_block_stride, a.k_token_stride, table, a.block_size, k0, nk, ahead, d, t.kp);
        const bool v_bad =
            widen_rows<S>(vc, a.v_block_stride, a.v_token_stride, table, a.block_size, k0, nk, ahead, d, t.vp);
        prefill_scores(t, nk);
        prefill_softmax(t, a, nk, k0, masked, 1.0f, false);
        if (masked && v_bad) prefill_values_visible(t, a, nk, k0);
        else prefill_values(t, nk);
    }
    prefill_finish(c, t, s, kvh, i0, tmp);
}
