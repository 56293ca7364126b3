// paged_attention.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// paged_attention, variable length: the new tokens of a batch mixing prompts, prompt chunks and
// decoding sequences (hal_cpu_attention_args), causal aligned bottom-right, with an optional
// sliding window, logit softcap, sinks and ALiBi. One kernel, two kinds of task:
//
// - rows of a sequence with one new token (decode) are bandwidth-bound: a task covers one sequence
//   (or one partition of its keys, split-KV) and every KV head, walking its blocks in order and,
//   inside a block, its KV heads, so each block's K (and V) rows of all heads are one contiguous
//   run the hardware prefetcher streams; per head, register tiles of (keys x query heads) dot
//   products, an online softmax and register tiles of (query heads x columns) for P @ V.
// - sequences with several new tokens (prefill, prompt chunks) are compute-bound: a task owns one
//   KV head and a tile of query tokens, whose rows (token x GQA head) share every K/V tile it reads.
//   Per tile of keys, K and V are widened once into float32 rows, S^T = K Q^T runs in register
//   tiles with the query rows in the vector lanes, so the online softmax is lane-wise (no
//   horizontal reduction) and P^T is already the layout P @ V broadcasts from; tiles the causal
//   mask or the window hide entirely are never visited. bf16 and fp16 run both products on AMX
//   tiles where the CPU and the OS allow it (attention_amx.inl).
// ---------------------------------------------------------------------------------------------

//: Decode: tokens scored per step (a block, or a slice of a long block); a multiple of every W.
constexpr int kChunk = 32;
//: Decode: bytes of K and V (all heads) between a step and the rows it prefetches: about a block or two, well inside L2.
constexpr int64_t kLookaheadBytes = 96 * 1024;

//: Prefill: keys per tile (K and V widened to float32 rows once per tile, for every query row of the task).
constexpr int kKeyTile = 64;
#if defined(HAL_ISA_AVX512)
//: S^T register tile: kQkKeys keys x kQkRowVecs vectors of query rows (24 of the 32 zmm registers).
constexpr int kQkKeys = 6, kQkRowVecs = 4;
//: P @ V register tile: kPvRows query rows x kPvVecs vectors of columns.
constexpr int kPvRows = 6, kPvVecs = 4;
#else
constexpr int kQkKeys = 4, kQkRowVecs = 2;  // 8 accumulators of 16 registers
constexpr int kPvRows = 4, kPvVecs = 2;
#endif

//: What every task reads besides the arguments: derived once per call.
struct AttnCtx {
    const hal_cpu_attention_args *a;
    int gq;          // query heads per KV head
    bool bf16_dot;   // decode: bf16 scores by vdpbf16ps (AVX512_BF16, head size a multiple of 32)
    bool amx;        // prefill: bf16/fp16 products on AMX tiles
    // Row of sequence s's first new token, and its count of new tokens.
    int64_t row0(int s) const { return a->query_start_loc ? a->query_start_loc[s] : s; }
    int q_len(int s) const { return a->query_start_loc ? a->query_start_loc[s + 1] - a->query_start_loc[s] : 1; }
    float sink(int h) const { return a->sinks ? a->sinks[h] : -kInf; }
    float slope(int h) const { return a->alibi_slopes ? a->alibi_slopes[h] : 0.0f; }
};

// ---------------------------------------------------------------------------------------------
// Shared by both kinds of task: the score transform, the final normalisation, the output store.
// ---------------------------------------------------------------------------------------------

// tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) <= 1 (the range V::exp serves); NaN stays NaN.
inline V::f vtanh(V::f y) {
    const V::f e = V::exp(V::mul(V::set1(-2.0f), V::abs(y)));
    const V::f one = V::set1(1.0f);
    return V::copysign(V::div(V::sub(one, e), V::add(one, e)), y);
}

// Softcap then ALiBi on scores x (scale applied): softcap * tanh(x / softcap) + slope * rel, rel = t - p.
inline V::f mod_scores(V::f x, float softcap, V::f rel, V::f slope) {
    if (softcap > 0.0f) {
        const V::f c = V::set1(softcap);
        x = V::mul(c, vtanh(V::div(x, c)));
    }
    return V::fma(slope, rel, x);
}

// Round-to-nearest-even float32 -> fp16 / bf16 bits (NaN stays a quiet NaN).
inline uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= (143u << 23)) {  // >= 65536 after rounding range, inf or NaN
        o = x > (255u << 23) ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) {  // fp16 subnormal or zero: let the FPU round at the fp16 subnormal step
        const uint32_t magic_bits = 126u << 23;
        float magic, v;
        std::memcpy(&magic, &magic_bits, 4);
        std::memcpy(&v, &x, 4);
        v += magic;
        uint32_t r;
        std::memcpy(&r, &v, 4);
        o = uint16_t(r - magic_bits);
    } else {
        const uint32_t odd = (x >> 13) & 1u;
        x += (uint32_t(15 - 127) << 23) + 0xfffu + odd;
        o = uint16_t(x >> 13);
    }
    return uint16_t(o | (sign >> 16));
}

inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// v[0, d) to out in out_dtype.
inline void store_row(const float *v, int d, void *out, int32_t out_dtype) {
    if (out_dtype == HAL_F32) {
        std::memcpy(out, v, sizeof(float) * size_t(d));
        return;
    }
    uint16_t *o = static_cast<uint16_t *>(out);
    int e = 0;
#if defined(HAL_ISA_AVX512)
    if (out_dtype == HAL_F16)
        for (; e + 16 <= d; e += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(o + e),
                                _mm512_cvtps_ph(_mm512_loadu_ps(v + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    if (out_dtype == HAL_F16)
        for (; e < d; ++e) o[e] = f32_to_f16_bits(v[e]);
    else
        for (; e < d; ++e) o[e] = f32_to_bf16_bits(v[e]);
}

// One output row from its online-softmax state (max m, denominator l, unnormalised acc) and the head's sink
// (-inf: none): softmax over [scores..., sink], the sink's value row zero. A NaN state, or a final max of +/-inf,
// gives NaN, as the float64 reference does.
inline void finish_row(float m, float l, const float *acc, float sink, int d, void *out, int32_t out_dtype,
                       float *tmp) {
    const float top = std::max(m, sink);
    const bool bad = m != m || sink != sink || !std::isfinite(top);
    const float w = m == -kInf ? 0.0f : std::exp(m - top);
    const float denom = l * w + (sink == -kInf ? 0.0f : std::exp(sink - top));
    const V::f f = V::set1(bad ? kNaN : w / denom);  // NaN * anything is NaN
    int e = 0;
    for (; e + W <= d; e += W) V::store(tmp + e, V::mul(V::load(acc + e), f));
    for (; e < d; ++e) tmp[e] = bad ? kNaN : acc[e] * (w / denom);
    store_row(tmp, d, out, out_dtype);
}

inline void *out_row(const hal_cpu_attention_args &a, int64_t row, int h) {
    const int64_t elem = a.out_dtype == HAL_F32 ? 4 : 2;
    return static_cast<char *>(a.out) + (row * a.out_token_stride + int64_t(h) * a.head_size) * elem;
}

// ---------------------------------------------------------------------------------------------
// Decode tasks (one new token per sequence)
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

// ---------------------------------------------------------------------------------------------
// Prefill tasks (several new tokens): one KV head, a tile of query tokens
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

#if defined(HAL_ISA_AVX512)
#include "attention_amx.inl"
#else
inline bool attention_amx() { return false; }
#endif

inline int attention_amx_enabled() { return attention_amx() ? 1 : 0; }

// ---------------------------------------------------------------------------------------------
// Planning: tasks of both kinds in one parallel pass, costliest first; then the split decode rows' merges.
// ---------------------------------------------------------------------------------------------
template <class S>
int paged_attention_t(const AttnCtx &c) {
    const hal_cpu_attention_args &a = *c.a;
    struct Task { int32_t s, kvh; int64_t t0, t1; int64_t part; double cost; };  // kvh < 0: decode
    std::vector<Task> tasks;
    std::vector<int64_t> first_part(size_t(a.num_seqs), -1);
    std::vector<int32_t> nparts(size_t(a.num_seqs), 0);
    int64_t parts_total = 0;
    const int64_t tile_cap = a.max_query_len > 0 ? a.max_query_len : INT32_MAX;
    std::vector<float> zeros(size_t(a.head_size), 0.0f);
    for (int s = 0; s < a.num_seqs; ++s) {
        const int64_t len = a.seq_lens[s];
        const int n = c.q_len(s);
        if (n <= 0) continue;
        if (n == 1) {
            if (len <= 0) {  // decode of an empty sequence: zeros
                for (int h = 0; h < a.num_heads; ++h) store_row(zeros.data(), a.head_size, out_row(a, c.row0(s), h), a.out_dtype);
                continue;
            }
            const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
            const int64_t ptok = a.partition_tokens > 0 ? a.partition_tokens : len - lo;
            const int np = int((len - lo + ptok - 1) / ptok);
            nparts[s] = np;
            if (np > 1) first_part[s] = parts_total;
            for (int p = 0; p < np; ++p) {
                const int64_t t0 = lo + p * ptok, t1 = std::min(len, t0 + ptok);
                tasks.push_back({s, -1, t0, t1, np > 1 ? parts_total + p : -1, double(t1 - t0) * a.num_heads});
            }
            if (np > 1) parts_total += np;
            continue;
        }
        const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(a.query_tile > 0 ? a.query_tile : n, tile_cap));
        for (int64_t i0 = 0; i0 < n; i0 += tile) {
            const int64_t i1 = std::min<int64_t>(n, i0 + tile), p_hi = len - n + i1 - 1;
            const int64_t k0 = a.window > 0 ? std::max<int64_t>(0, len - n + i0 - a.window + 1) : 0;
            const double cost = double(i1 - i0) * c.gq * double(p_hi + 1 - k0);
            for (int kvh = 0; kvh < a.num_kv_heads; ++kvh) tasks.push_back({s, kvh, i0, i1, -1, cost});
        }
    }
    const int64_t pstride = int64_t(a.num_heads) * (a.head_size + 2);
    std::vector<float> parts(size_t(parts_total) * pstride);
    // Costliest tasks first: dynamic scheduling then balances the ragged tail.
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task &x, const Task &y) { return x.cost > y.cost; });
    parallel_for(int64_t(tasks.size()), a.threads, [&](int64_t i) {
        const Task &t = tasks[i];
        if (t.kvh < 0) decode_task<S>(c, t.s, t.t0, t.t1, t.part >= 0 ? parts.data() + t.part * pstride : nullptr);
#if defined(HAL_ISA_AVX512)
        else if (c.amx) prefill_task_amx<S>(c, t.s, t.kvh, int(t.t0), int(t.t1));
#endif
        else prefill_task<S>(c, t.s, t.kvh, int(t.t0), int(t.t1));
    });
    if (parts_total) {
        parallel_for(int64_t(a.num_seqs) * a.num_kv_heads, a.threads, [&](int64_t i) {
            const int s = int(i / a.num_kv_heads);
            if (first_part[s] >= 0)
                decode_merge(c, s, int(i % a.num_kv_heads), parts.data() + first_part[s] * pstride, nparts[s]);
        });
    }
    return HAL_OK;
}

int paged_attention(const hal_cpu_attention_args *args) {
    const hal_cpu_attention_args &a = *args;
    AttnCtx c{args, a.num_heads / a.num_kv_heads, a.dtype == HAL_BF16 && a.head_size % 32 == 0 && cpu_has_bf16_dot(),
              a.dtype != HAL_F32 && attention_amx()};
    try {
        if (a.dtype == HAL_F16) return paged_attention_t<F16>(c);
        if (a.dtype == HAL_BF16) return paged_attention_t<BF16>(c);
        return paged_attention_t<F32>(c);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
