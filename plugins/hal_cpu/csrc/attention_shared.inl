// attention_shared.inl: included by paged_attention.inl inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// What both kinds of paged_attention task share: the tile sizes, the per-call context (AttnCtx), the
// score transform (softcap, ALiBi), the final normalisation with the sinks, and the output store.
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

// W float32 lanes x[0, W) rounded to bf16 bits (round to nearest even: the carry trick on the bits) into out. A NaN
// lane becomes the quiet NaN of its sign (0x7fc0 | sign, as ml_dtypes) when `canonical`, else its own top half made
// quiet (f32_to_bf16_bits). The scalar functions' bits, W at a time.
#if defined(HAL_ISA_AVX512)
inline void bf16_rne_lanes(const float *x, uint16_t *out, bool canonical) {
    const __m512 v = _mm512_loadu_ps(x);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __m512i nan_bits = canonical
        ? _mm512_or_si512(_mm512_and_si512(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0))
        : _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan_bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm512_cvtepi32_epi16(r));
}
// W float32 lanes rounded to fp16 (the FPU's round to nearest even) into out.
inline void f16_rne_lanes(const float *x, uint16_t *out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define HAL_HALF_LANES 1
#elif defined(HAL_ISA_AVX2)
inline void bf16_rne_lanes(const float *x, uint16_t *out, bool canonical) {
    const __m256 v = _mm256_loadu_ps(x);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan_bits = canonical
        ? _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0))
        : _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan_bits, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // every lane is at most 0xffff: the unsigned saturation of the pack never bites
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void f16_rne_lanes(const float *x, uint16_t *out) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define HAL_HALF_LANES 1
#endif

// v[0, d) to out in out_dtype.
inline void store_row(const float *v, int d, void *out, int32_t out_dtype) {
    if (out_dtype == HAL_F32) {
        std::memcpy(out, v, sizeof(float) * size_t(d));
        return;
    }
    uint16_t *o = static_cast<uint16_t *>(out);
    int e = 0;
#if defined(HAL_HALF_LANES)
    if (out_dtype == HAL_F16)
        for (; e + W <= d; e += W) f16_rne_lanes(v + e, o + e);
    else
        for (; e + W <= d; e += W) bf16_rne_lanes(v + e, o + e, false);
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
