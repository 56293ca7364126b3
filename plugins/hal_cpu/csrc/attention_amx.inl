// attention_amx.inl: included by paged_attention.inl in the AVX-512 variants; not a standalone header.
// ---------------------------------------------------------------------------------------------
// Prefill tasks of bf16/fp16 attention on AMX tiles (tdpbf16ps: a 16 x 32 by 32 x 16 bf16 product
// added to 16 x 16 float32 per instruction, products exact, float32 sums).
//
// The task is prefill_task's (one KV head, a tile of query tokens, online softmax lane-wise over the
// query rows), with both products moved to tiles:
// - S^T = K Q^T: A = 16 keys x 32 columns of K (rows copied from the cache, bf16), B = the query
//   rows in the pair layout AMX wants (built once per task), C = 16 keys x 16 query rows, stored
//   straight into S^T's layout, so prefill_softmax runs unchanged (the scale applied there);
// - O = P V: A = 16 query rows x 32 keys of P (the softmax's P^T transposed in 16 x 16 blocks and
//   rounded to bf16), B = V with pairs of key rows interleaved, C = O, 16 rows x 16 columns.
// fp16 is split exactly into two bf16 parts (hi: the top 8 significant bits, lo: the rest, at most
// 3 bits), and each product is hi.hi + hi.lo + lo.hi (the lo.lo term is below 2**-16 relative):
// rounding fp16 to one bf16 would lose 3 bits, past the fp16 tolerance. P is split the same way for
// fp16 V; for bf16 it is rounded once, and the softmax sums the rounded values, so the output stays
// a convex combination of value rows.
//
// AMX needs the OS's permission for the tile state (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), once per process); without the CPU feature or the permission, or with
// hal_cpu_set_attention_amx(0), prefill_task runs instead. Head sizes must be multiples of 32.
// ---------------------------------------------------------------------------------------------
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

// Whether this CPU has AMX-TILE and AMX-BF16 and the OS granted this process the tile state (asked once).
inline bool amx_usable() {
    static const bool usable = [] {
        unsigned eax, ebx, ecx, edx;
        if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
        const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
        if (!tile || !bf16 || !__builtin_cpu_supports("avx512bf16")) return false;
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return usable;
}

// Whether this CPU has AMX-TILE and AMX-INT8 and the OS granted this process the tile state (asked once): the
// integer GEMMs' tile paths (w4a8_amx.inl, w8a8_amx.inl).
inline bool amx_int8_usable() {
    static const bool usable = [] {
        unsigned eax, ebx, ecx, edx;
        if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
        if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return usable;
}

// hal_cpu_set_attention_amx (HAL_CPU_AMX) may turn it off for the whole process.
inline bool attention_amx() { return hal_cpu_attention_amx_allowed() && amx_usable(); }

//: Keys per tile (a multiple of 32: P V takes 32 keys per tile product): twice the vector path's, so that loading
//: and storing the output tiles around P V costs half as much per product.
constexpr int kKeyTileAmx = 128;

#define HAL_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define HAL_AMX_INT8 __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512bf16")))
#define HAL_AMX_BARRIER() __asm__ volatile("" ::: "memory")  // tile loads are asm without memory operands

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes.
HAL_AMX inline void amx_configure() {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    HAL_AMX_BARRIER();
    _tile_loadconfig(&cfg);
}

// x as bf16 (round to nearest even) and the remainder x - hi as bf16: two parts whose sum is x to 16 significant
// bits (exact for fp16 inputs).
HAL_AMX inline void split_bf16(__m512 x, __m256i &hi, __m256i &lo) {
    const __m256bh h = _mm512_cvtneps_pbh(x);
    hi = (__m256i)h;
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    // An infinite x is all hi (inf - inf would make lo NaN); NaN stays in hi.
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(kInf), _CMP_LT_OQ);
    lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(finite, x, back));
}

// 16 floats of a storage row as float32 (fp16 widened, bf16 shifted).
template <class S>
inline __m512 amx_widen(const typename S::T *p) { return vload<S>(p); }

// What an AMX prefill task keeps besides PrefillTile: the bf16 parts of Q (pair layout), K, V (pair layout)
// and P. parts = 1 (bf16) or 2 (fp16: hi, lo).
struct AmxTile {
    int parts, nkp;  // nkp: keys per tile rounded up to 32
    uint16_t *qv[2];  // [d/32][mp/16][16 pair rows][16 rows x 2]
    uint16_t *kb[2];  // [nkp][d]
    uint16_t *vv[2];  // [nkp/2][d][2]
    uint16_t *pb[2];  // [mp][nkp]
};

// The query rows in the B layout of S^T = K Q^T: element (pair row r, query row m) holds Q[m][2r], Q[m][2r+1].
// Each row's 32 values of a chunk are 16 such pairs: one scatter puts them in their column. Returns whether any query
// value is not finite.
template <class S>
HAL_AMX inline bool amx_pack_queries(const AttnCtx &c, const PrefillTile &t, AmxTile &x, int s, int kvh, int i0) {
    using T = typename S::T;
    const hal_cpu_attention_args &a = *c.a;
    const int d = t.d, gq = c.gq, mblocks = t.mp / 16;
    const T *query = static_cast<const T *>(a.query);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    __mmask16 bad = 0;
    for (int r = 0; r < t.mp; ++r) {
        const int i = i0 + std::min(r, t.rows - 1) / gq, h = kvh * gq + r % gq;
        const T *q = query + (c.row0(s) + i) * a.q_token_stride + int64_t(h) * a.q_head_stride;
        const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32(r % 16));
        for (int ch = 0; ch < d / 32; ++ch) {
            __m256i hi[2], lo[2];
            for (int half = 0; half < 2; ++half) {
                const __m512 f = r < t.rows ? amx_widen<S>(q + ch * 32 + half * 16) : _mm512_setzero_ps();
                bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(kInf), _CMP_NLT_UQ);
                split_bf16(f, hi[half], lo[half]);
            }
            const int64_t block = (int64_t(ch) * mblocks + r / 16) * 512;  // uint16 elements of one B tile
            _mm512_i32scatter_epi32(x.qv[0] + block, at, _mm512_inserti64x4(_mm512_castsi256_si512(hi[0]), hi[1], 1), 4);
            if (x.parts == 2)
                _mm512_i32scatter_epi32(x.qv[1] + block, at, _mm512_inserti64x4(_mm512_castsi256_si512(lo[0]), lo[1], 1), 4);
        }
    }
    return bad != 0;
}

// 16 pairs (a[j], b[j]) of 16-bit values as 16 dwords, a in the low half: two key rows in the pair layout.
HAL_AMX inline __m512i pair_rows(__m256i a, __m256i b) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Keys [k0, k0 + nk) of K (rows) and V (pairs of rows interleaved) as bf16 parts; rows up to nkp are zero.
// Sets k_bad / v_bad when any value of K / V is not finite. Keys below next_end after the tile are prefetched.
template <class S>
HAL_AMX inline void amx_pack_keys(const hal_cpu_attention_args &a, const AmxTile &x, const int32_t *table,
                                  const typename S::T *kc, const typename S::T *vc, int64_t k0, int nk,
                                  int64_t next_end, int d, bool &k_bad, bool &v_bad) {
    using T = typename S::T;
    const int bs = a.block_size;
    const auto row = [&](const T *cache, int64_t bstride, int64_t tstride, int n) -> const T * {
        if (n >= nk) return nullptr;
        const int64_t t = k0 + n;
        return cache + int64_t(table[t / bs]) * bstride + (t % bs) * tstride;
    };
    // The next tile's rows (same offsets, a tile on) are prefetched into L2 while this one is packed: a tile
    // of products later they are there (the rows are scattered over blocks; a miss per row otherwise stalls here).
    const int ahead = int(std::min<int64_t>(nk, next_end - (k0 + nk)));
    const auto prefetch = [&](const T *cache, int64_t bstride, int64_t tstride, int n) {
        if (n >= ahead) return;
        const int64_t t = k0 + nk + n;
        const char *p = reinterpret_cast<const char *>(cache + int64_t(table[t / bs]) * bstride + (t % bs) * tstride);
        for (int64_t b = 0; b < int64_t(d) * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
    };
    // 16 values of a row as bf16 parts (zeros past the keys); nonfinite collects Inf/NaN lanes of V.
    const auto parts = [&](const T *r, int e, __m256i &hi, __m256i &lo, __mmask16 *nonfinite) {
        if (!r) {
            hi = lo = _mm256_setzero_si256();
            return;
        }
        if constexpr (std::is_same<S, BF16>::value) {
            hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(r + e));
            lo = _mm256_setzero_si256();
            if (nonfinite) {
                const __m256i ex = _mm256_set1_epi16(0x7f80);
                *nonfinite |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(hi, ex), ex);
            }
        } else {
            const __m512 f = vload<S>(r + e);
            if (nonfinite) {
                const __m512 inf = _mm512_set1_ps(kInf);
                *nonfinite |= _mm512_cmp_ps_mask(_mm512_abs_ps(f), inf, _CMP_NLT_UQ);  // |f| >= inf or NaN
            }
            split_bf16(f, hi, lo);
        }
    };
    __mmask16 kbad = 0, vbad = 0;
    for (int n = 0; n < x.nkp; n += 2) {
        const T *ka = row(kc, a.k_block_stride, a.k_token_stride, n), *kb = row(kc, a.k_block_stride, a.k_token_stride, n + 1);
        const T *va = row(vc, a.v_block_stride, a.v_token_stride, n), *vb = row(vc, a.v_block_stride, a.v_token_stride, n + 1);
        for (int j = n; j < n + 2; ++j) {
            prefetch(kc, a.k_block_stride, a.k_token_stride, j);
            prefetch(vc, a.v_block_stride, a.v_token_stride, j);
        }
        for (int e = 0; e < d; e += 16) {
            __m256i h0, l0, h1, l1;
            parts(ka, e, h0, l0, &kbad);
            parts(kb, e, h1, l1, &kbad);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(x.kb[0] + int64_t(n) * d + e), h0);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(x.kb[0] + int64_t(n + 1) * d + e), h1);
            if (x.parts == 2) {
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(x.kb[1] + int64_t(n) * d + e), l0);
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(x.kb[1] + int64_t(n + 1) * d + e), l1);
            }
            parts(va, e, h0, l0, &vbad);
            parts(vb, e, h1, l1, &vbad);
            const int64_t at = (int64_t(n / 2) * d + e) * 2;
            _mm512_storeu_si512(x.vv[0] + at, pair_rows(h0, h1));
            if (x.parts == 2) _mm512_storeu_si512(x.vv[1] + at, pair_rows(l0, l1));
        }
    }
    k_bad = kbad != 0;
    v_bad = vbad != 0;
}

// S^T[n][m] (float32, unscaled) for the tile's nkp keys and every query row: 2 x 2 blocks of C tiles.
HAL_AMX inline void amx_scores(const PrefillTile &t, const AmxTile &x) {
    const int d = t.d, mblocks = t.mp / 16, dchunks = d / 32;
    const int64_t kstride = int64_t(d) * 2, qstride = 64, sstride = int64_t(t.mp) * 4;
    HAL_AMX_BARRIER();
    for (int nb = 0; nb < x.nkp / 16; nb += 2) {
        const bool two_n = nb + 1 < x.nkp / 16;
        for (int mb = 0; mb < mblocks; mb += 2) {
            const bool two_m = mb + 1 < mblocks;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int ch = 0; ch < dchunks; ++ch) {
                for (int part = 0; part < (x.parts == 2 ? 3 : 1); ++part) {
                    // part 0: hi.hi, 1: lo(K).hi(Q), 2: hi(K).lo(Q)
                    const uint16_t *kb = x.kb[part == 1 ? 1 : 0], *qv = x.qv[part == 2 ? 1 : 0];
                    const uint16_t *k0 = kb + int64_t(nb * 16) * d + ch * 32;
                    const uint16_t *q0 = qv + (int64_t(ch) * mblocks + mb) * 512;
                    _tile_loadd(4, k0, kstride);
                    _tile_loadd(6, q0, qstride);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_m) {
                        _tile_loadd(7, q0 + 512, qstride);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two_n) {
                        _tile_loadd(5, k0 + 16 * d, kstride);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two_m) _tile_dpbf16ps(3, 5, 7);
                    }
                }
            }
            float *s0 = t.st + int64_t(nb * 16) * t.mp + mb * 16;
            _tile_stored(0, s0, sstride);
            if (two_m) _tile_stored(1, s0 + 16, sstride);
            if (two_n) {
                _tile_stored(2, s0 + 16 * t.mp, sstride);
                if (two_m) _tile_stored(3, s0 + 16 * t.mp + 16, sstride);
            }
        }
    }
    HAL_AMX_BARRIER();
}

// P (rows x keys, bf16 parts, the A layout of P V) from P^T (keys x rows, float32); keys past nk are zero. Rows 2k and
// 2k + 1 of P^T become one vector of pairs (lanes: query rows), and each 16 x 16 block of pairs is transposed.
HAL_AMX inline void amx_pack_probs(const PrefillTile &t, const AmxTile &x, int nk) {
    alignas(64) uint32_t blk[2][16][16];
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int n0 = 0; n0 < x.nkp; n0 += 32)
        for (int m0 = 0; m0 < t.mp; m0 += 16) {
            for (int k = 0; k < 16; ++k) {
                const int n = n0 + 2 * k;
                const __m512 r0 = n < nk ? _mm512_loadu_ps(t.st + int64_t(n) * t.mp + m0) : _mm512_setzero_ps();
                const __m512 r1 = n + 1 < nk ? _mm512_loadu_ps(t.st + int64_t(n + 1) * t.mp + m0) : _mm512_setzero_ps();
                __m256i h0, l0, h1, l1;
                split_bf16(r0, h0, l0);
                split_bf16(r1, h1, l1);
                _mm512_store_si512(blk[0][k], pair_rows(h0, h1));
                if (x.parts == 2) _mm512_store_si512(blk[1][k], pair_rows(l0, l1));
            }
            for (int p = 0; p < x.parts; ++p)
                for (int j = 0; j < 16; ++j)  // row m0 + j: the pairs of keys n0 .. n0 + 31
                    _mm512_storeu_si512(x.pb[p] + int64_t(m0 + j) * x.nkp + n0,
                                        _mm512_i32gather_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(j)), &blk[p][0][0], 4));
        }
}

// o = alpha o + P V for every row (rows padded to mp: the padding rows' P is the last real row's, harmless).
HAL_AMX inline void amx_values(const PrefillTile &t, const AmxTile &x) {
    const int d = t.d, mblocks = t.mp / 16, cblocks = d / 16;
    // o lives as [mp][d]; padding rows beyond t.rows are scratch (the caller sized o for mp rows).
    bool rescale = false;  // once the running maxima settle, every alpha is 1
    for (int r = 0; r < t.rows; ++r) rescale |= t.alpha[r] != 1.0f;
    for (int r = 0; r < t.rows && rescale; ++r) {
        const __m512 al = _mm512_set1_ps(t.alpha[r]);
        for (int e = 0; e < d; e += 16) _mm512_storeu_ps(t.o + int64_t(r) * d + e, _mm512_mul_ps(_mm512_loadu_ps(t.o + int64_t(r) * d + e), al));
    }
    const int64_t ostride = int64_t(d) * 4, pstride = int64_t(x.nkp) * 2, vstride = int64_t(d) * 4;
    HAL_AMX_BARRIER();
    for (int mb = 0; mb < mblocks; mb += 2) {
        const bool two_m = mb + 1 < mblocks;
        for (int cb = 0; cb < cblocks; cb += 2) {
            const bool two_c = cb + 1 < cblocks;
            float *o0 = t.o + int64_t(mb * 16) * d + cb * 16;
            _tile_loadd(0, o0, ostride);
            if (two_c) _tile_loadd(1, o0 + 16, ostride);
            if (two_m) {
                _tile_loadd(2, o0 + 16 * d, ostride);
                if (two_c) _tile_loadd(3, o0 + 16 * d + 16, ostride);
            }
            for (int kc = 0; kc < x.nkp; kc += 32) {
                for (int part = 0; part < (x.parts == 2 ? 3 : 1); ++part) {
                    // part 0: hi(P).hi(V), 1: lo(P).hi(V), 2: hi(P).lo(V)
                    const uint16_t *pb = x.pb[part == 1 ? 1 : 0], *vv = x.vv[part == 2 ? 1 : 0];
                    const uint16_t *p0 = pb + int64_t(mb * 16) * x.nkp + kc;
                    const uint16_t *v0 = vv + (int64_t(kc / 2) * d + cb * 16) * 2;
                    _tile_loadd(4, p0, pstride);
                    _tile_loadd(6, v0, vstride);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_c) {
                        _tile_loadd(7, v0 + 32, vstride);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two_m) {
                        _tile_loadd(5, p0 + 16 * x.nkp, pstride);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two_c) _tile_dpbf16ps(3, 5, 7);
                    }
                }
            }
            _tile_stored(0, o0, ostride);
            if (two_c) _tile_stored(1, o0 + 16, ostride);
            if (two_m) {
                _tile_stored(2, o0 + 16 * d, ostride);
                if (two_c) _tile_stored(3, o0 + 16 * d + 16, ostride);
            }
        }
    }
    HAL_AMX_BARRIER();
}

template <class S>
HAL_AMX void prefill_task_amx(const AttnCtx &c, int s, int kvh, int i0, int i1) {
    using T = typename S::T;
    const hal_cpu_attention_args &a = *c.a;
    const int gq = c.gq, d = a.head_size;
    if (d % 32 != 0) return prefill_task<S>(c, s, kvh, i0, i1);
    PrefillTile t;
    AmxTile x;
    x.parts = std::is_same<S, F16>::value ? 2 : 1;
    x.nkp = kKeyTileAmx;
    t.rows = (i1 - i0) * gq;
    t.mp = (t.rows + 15) / 16 * 16;
    t.d = d;
    const size_t halves = size_t(x.parts) * (size_t(d) * t.mp + 2 * size_t(x.nkp) * d + size_t(t.mp) * x.nkp);
    std::vector<float> buf(size_t(t.mp) * d + size_t(x.nkp) * t.mp + 6 * size_t(t.mp) + size_t(d) + halves / 2 + 32);
    t.o = buf.data();
    t.st = t.o + size_t(t.mp) * d;
    t.pos = t.st + size_t(x.nkp) * t.mp;
    t.slope = t.pos + t.mp;
    t.m = t.slope + t.mp;
    t.l = t.m + t.mp;
    t.alpha = t.l + t.mp;
    float *tmp = t.alpha + t.mp;
    uint16_t *h = reinterpret_cast<uint16_t *>(tmp + d + t.mp);
    h = reinterpret_cast<uint16_t *>((reinterpret_cast<uintptr_t>(h) + 63) & ~uintptr_t(63));
    for (int p = 0; p < x.parts; ++p) {
        x.qv[p] = h;
        h += size_t(d) * t.mp;
        x.kb[p] = h;
        h += size_t(x.nkp) * d;
        x.vv[p] = h;
        h += size_t(x.nkp) * d;
        x.pb[p] = h;
        h += size_t(t.mp) * x.nkp;
    }
    t.qt = t.kp = t.vp = nullptr;
    // Non-finite inputs follow IEEE arithmetic only where every product is a plain product: the generic task runs
    // instead when a split part would meet an infinity (0 * inf in lo * hi), or a hidden key's non-finite value
    // would reach a row as 0 * v.
    if (amx_pack_queries<S>(c, t, x, s, kvh, i0) && x.parts == 2) return prefill_task<S>(c, s, kvh, i0, i1);
    std::fill(t.o, t.o + size_t(t.mp) * d, 0.0f);
    const PrefillRange range = prefill_rows(c, t, s, kvh, i0, i1);
    const int64_t k_end = range.k_end;
    const int32_t *table = a.block_tables + s * a.bt_stride;
    const T *kc = static_cast<const T *>(a.key_cache) + kvh * a.k_head_stride;
    const T *vc = static_cast<const T *>(a.value_cache) + kvh * a.v_head_stride;
    amx_configure();
    for (int64_t k0 = range.k_begin; k0 < k_end; k0 += kKeyTileAmx) {
        const int nk = int(std::min<int64_t>(kKeyTileAmx, k_end - k0));
        const bool masked = range.masked(k0, nk, a.window);
        bool k_bad, v_bad;
        amx_pack_keys<S>(a, x, table, kc, vc, k0, nk, k_end, d, k_bad, v_bad);
        if ((x.parts == 2 && (k_bad || v_bad)) || (masked && v_bad)) {
            _tile_release();
            return prefill_task<S>(c, s, kvh, i0, i1);
        }
        amx_scores(t, x);
        prefill_softmax(t, a, nk, k0, masked, a.scale, x.parts == 1);
        amx_pack_probs(t, x, nk);
        amx_values(t, x);
    }
    _tile_release();
    prefill_finish(c, t, s, kvh, i0, tmp);
}
