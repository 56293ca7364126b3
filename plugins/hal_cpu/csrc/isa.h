// The vector layer every kernel is written against, one definition per instruction set.
//
// kernels.cpp is compiled once per variant with HAL_ISA_AVX512, HAL_ISA_AVX2 or
// neither (the portable baseline, plain loops the compiler vectorises for the
// target's base ISA: SSE2 on x86-64, NEON on aarch64). Each variant offers the
// same names: V::f (W float lanes), V::i (W int32 lanes) and the operations below.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(HAL_ISA_AVX512) || defined(HAL_ISA_AVX2)
#include <immintrin.h>
#endif

namespace hal {

// Exact scalar conversions (tails and the baseline variant).
inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t mag = h & 0x7fffu;
    uint32_t bits = mag << 13;
    float f;
    if (mag >= 0x7c00u) {  // inf / nan: exponent all ones
        bits |= 0x7f800000u;
        std::memcpy(&f, &bits, 4);
    } else {
        std::memcpy(&f, &bits, 4);
        f *= 5.192296858534828e+33f;  // 2**112 rebiases the exponent, subnormals included
    }
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

struct F32 { using T = float; static float scalar(const T *p) { return *p; } };
struct F16 { using T = uint16_t; static float scalar(const T *p) { return f16_to_f32(*p); } };
struct BF16 { using T = uint16_t; static float scalar(const T *p) { return bf16_to_f32(*p); } };

#if defined(HAL_ISA_AVX512)
#define HAL_ISA_NAME avx512
struct V {
    static constexpr int W = 16;
    using f = __m512;
    using i = __m512i;
    static f zero() { return _mm512_setzero_ps(); }
    static f set1(float x) { return _mm512_set1_ps(x); }
    static f load(const float *p) { return _mm512_loadu_ps(p); }
    static f load(const F32 *, const float *p) { return _mm512_loadu_ps(p); }
    static f load(const F16 *, const uint16_t *p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    }
    static f load(const BF16 *, const uint16_t *p) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    static f load_u8(const uint8_t *p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
    }
    static void store(float *p, f v) { _mm512_storeu_ps(p, v); }
    static f add(f a, f b) { return _mm512_add_ps(a, b); }
    static f sub(f a, f b) { return _mm512_sub_ps(a, b); }
    static f mul(f a, f b) { return _mm512_mul_ps(a, b); }
    static f fma(f a, f b, f c) { return _mm512_fmadd_ps(a, b, c); }
    static f fnma(f a, f b, f c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
    static f div(f a, f b) { return _mm512_div_ps(a, b); }
    static f abs(f a) { return _mm512_abs_ps(a); }
    static f copysign(f mag, f sgn) {  // |mag| with the sign of sgn
        const __m512i m = _mm512_set1_epi32(0x7fffffff);
        return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(m, _mm512_castps_si512(mag), _mm512_castps_si512(sgn), 0xCA));  // m ? mag : sgn
    }
    // a <= b ? x : y, lane by lane (a NaN lane compares false).
    static f select_le(f a, f b, f x, f y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x); }
    static float hsum(f v) { return _mm512_reduce_add_ps(v); }
    // out[i] = hsum(a_i) for four vectors at once (13 shuffles and adds instead of four reductions).
    static void hsum4(f a0, f a1, f a2, f a3, float *out) {
        f s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
        f s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
        f s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
        s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0x4E));
        s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
        _mm_storeu_ps(out, _mm512_castps512_ps128(s));
    }
    static i loadi(const uint32_t *p) { return _mm512_loadu_si512(p); }
    static i seti(uint32_t x) { return _mm512_set1_epi32(int(x)); }
    static i andi(i a, i b) { return _mm512_and_si512(a, b); }
    template <int S> static i srli(i a) { return _mm512_srli_epi32(a, S); }
    static f cvt(i a) { return _mm512_cvtepi32_ps(a); }
    // exp (NaN in, NaN out; 0 below the float range, inf above it, NaN for +inf): 2**n * p(r), |rel err| < 2e-7.
    static f exp(f x) {
        const f lo = set1(-87.3f);
        __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
        f n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
        f r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
        r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
        f p = poly(r);
        f e = _mm512_scalef_ps(p, n);
        return _mm512_mask_mov_ps(e, under, zero());
    }
    static f poly(f r) {
        f p = set1(1.9875691500e-4f);
        p = fma(p, r, set1(1.3981999507e-3f));
        p = fma(p, r, set1(8.3334519073e-3f));
        p = fma(p, r, set1(4.1665795894e-2f));
        p = fma(p, r, set1(1.6666665459e-1f));
        p = fma(p, r, set1(5.0000001201e-1f));
        p = fma(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.0f)));
        return p;
    }
};
#elif defined(HAL_ISA_AVX2)
#define HAL_ISA_NAME avx2
struct V {
    static constexpr int W = 8;
    using f = __m256;
    using i = __m256i;
    static f zero() { return _mm256_setzero_ps(); }
    static f set1(float x) { return _mm256_set1_ps(x); }
    static f load(const float *p) { return _mm256_loadu_ps(p); }
    static f load(const F32 *, const float *p) { return _mm256_loadu_ps(p); }
    static f load(const F16 *, const uint16_t *p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    }
    static f load(const BF16 *, const uint16_t *p) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    static f load_u8(const uint8_t *p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
    }
    static void store(float *p, f v) { _mm256_storeu_ps(p, v); }
    static f add(f a, f b) { return _mm256_add_ps(a, b); }
    static f sub(f a, f b) { return _mm256_sub_ps(a, b); }
    static f mul(f a, f b) { return _mm256_mul_ps(a, b); }
    static f fma(f a, f b, f c) { return _mm256_fmadd_ps(a, b, c); }
    static f fnma(f a, f b, f c) { return _mm256_fnmadd_ps(a, b, c); }
    static f div(f a, f b) { return _mm256_div_ps(a, b); }
    static f abs(f a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
    static f copysign(f mag, f sgn) {
        const f sign = _mm256_set1_ps(-0.0f);
        return _mm256_or_ps(_mm256_andnot_ps(sign, mag), _mm256_and_ps(sign, sgn));
    }
    static f select_le(f a, f b, f x, f y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
    static float hsum(f v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static void hsum4(f a0, f a1, f a2, f a3, float *out) {
        out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
    }
    static i loadi(const uint32_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
    static i seti(uint32_t x) { return _mm256_set1_epi32(int(x)); }
    static i andi(i a, i b) { return _mm256_and_si256(a, b); }
    template <int S> static i srli(i a) { return _mm256_srli_epi32(a, S); }
    static f cvt(i a) { return _mm256_cvtepi32_ps(a); }
    static f exp(f x) {
        f under = _mm256_cmp_ps(x, set1(-87.3f), _CMP_LT_OQ);
        f n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
        r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
        f p = set1(1.9875691500e-4f);
        p = fma(p, r, set1(1.3981999507e-3f));
        p = fma(p, r, set1(8.3334519073e-3f));
        p = fma(p, r, set1(4.1665795894e-2f));
        p = fma(p, r, set1(1.6666665459e-1f));
        p = fma(p, r, set1(5.0000001201e-1f));
        p = fma(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.0f)));
        // 2**n for n in [-126, 128]: (n + 127) << 23, 2**128 being +inf (an x past the float range overflows, as
        // AVX-512's scalef does); NaN lanes keep NaN through the multiply.
        f nc = _mm256_min_ps(_mm256_max_ps(n, set1(-126.0f)), set1(128.0f));
        __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nc), _mm256_set1_epi32(127)), 23);
        f e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        return _mm256_andnot_ps(under, e);
    }
};
#else
#define HAL_ISA_NAME baseline
// Portable: fixed-size arrays in plain loops, vectorised by the compiler for the base ISA.
struct V {
    static constexpr int W = 4;
    struct f { float v[4]; };
    struct i { uint32_t v[4]; };
    static f zero() { return f{{0, 0, 0, 0}}; }
    static f set1(float x) { return f{{x, x, x, x}}; }
    static f load(const float *p) { f r; std::memcpy(r.v, p, 16); return r; }
    static f load(const F32 *, const float *p) { return load(p); }
    static f load(const F16 *, const uint16_t *p) { f r; for (int l = 0; l < 4; ++l) r.v[l] = f16_to_f32(p[l]); return r; }
    static f load(const BF16 *, const uint16_t *p) { f r; for (int l = 0; l < 4; ++l) r.v[l] = bf16_to_f32(p[l]); return r; }
    static f load_u8(const uint8_t *p) { f r; for (int l = 0; l < 4; ++l) r.v[l] = float(p[l]); return r; }
    static void store(float *p, f a) { std::memcpy(p, a.v, 16); }
    static f add(f a, f b) { for (int l = 0; l < 4; ++l) a.v[l] += b.v[l]; return a; }
    static f sub(f a, f b) { for (int l = 0; l < 4; ++l) a.v[l] -= b.v[l]; return a; }
    static f mul(f a, f b) { for (int l = 0; l < 4; ++l) a.v[l] *= b.v[l]; return a; }
    static f fma(f a, f b, f c) { for (int l = 0; l < 4; ++l) c.v[l] += a.v[l] * b.v[l]; return c; }  // no FMA unit assumed
    static f fnma(f a, f b, f c) { for (int l = 0; l < 4; ++l) c.v[l] -= a.v[l] * b.v[l]; return c; }
    static f div(f a, f b) { for (int l = 0; l < 4; ++l) a.v[l] /= b.v[l]; return a; }
    static f abs(f a) { for (int l = 0; l < 4; ++l) a.v[l] = std::fabs(a.v[l]); return a; }
    static f copysign(f mag, f sgn) { for (int l = 0; l < 4; ++l) mag.v[l] = std::copysign(mag.v[l], sgn.v[l]); return mag; }
    static f select_le(f a, f b, f x, f y) { for (int l = 0; l < 4; ++l) x.v[l] = a.v[l] <= b.v[l] ? x.v[l] : y.v[l]; return x; }
    static float hsum(f a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
    static void hsum4(f a0, f a1, f a2, f a3, float *out) {
        out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
    }
    static i loadi(const uint32_t *p) { i r; std::memcpy(r.v, p, 16); return r; }
    static i seti(uint32_t x) { return i{{x, x, x, x}}; }
    static i andi(i a, i b) { for (int l = 0; l < 4; ++l) a.v[l] &= b.v[l]; return a; }
    template <int S> static i srli(i a) { for (int l = 0; l < 4; ++l) a.v[l] >>= S; return a; }
    static f cvt(i a) { f r; for (int l = 0; l < 4; ++l) r.v[l] = float(int32_t(a.v[l])); return r; }
    static f exp(f a) { for (int l = 0; l < 4; ++l) a.v[l] = a.v[l] < -87.3f ? 0.0f : std::exp(a.v[l]); return a; }
};
#endif


// ---------------------------------------------------------------------------------------------
// Attention helpers: register-tile sizes and reductions used by paged_attention (attention_*.inl).
//   kAttnAcc        vector accumulators one register tile may hold (what the variant's register file
//                   leaves after the operands: 32 zmm registers on AVX-512, 16 ymm/xmm elsewhere).
//   hsum_acc(a, o)  o[i] = sum of the lanes of a[i] for the kAttnAcc vectors a[0..kAttnAcc) at once
//                   (one transpose-reduce instead of kAttnAcc separate horizontal sums).
//   vmax(a, b)      lane-wise max that ignores a NaN in a (returns b's lane), hmax(a) its reduction.
// ---------------------------------------------------------------------------------------------
#if defined(HAL_ISA_AVX512)
constexpr int kAttnAcc = 16;
// Four vectors -> one whose 128-bit lane L holds their four partial sums over lane L.
[[gnu::always_inline]] inline __m512 hsum4_lanes(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
}
[[gnu::always_inline]] inline void hsum_acc(const V::f *a, float *out) {
    __m512 s0 = hsum4_lanes(a[0], a[1], a[2], a[3]), s1 = hsum4_lanes(a[4], a[5], a[6], a[7]);
    __m512 s2 = hsum4_lanes(a[8], a[9], a[10], a[11]), s3 = hsum4_lanes(a[12], a[13], a[14], a[15]);
    __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x44), _mm512_shuffle_f32x4(s0, s1, 0xEE));
    __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(s2, s3, 0x44), _mm512_shuffle_f32x4(s2, s3, 0xEE));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD)));
}
inline V::f vmax(V::f a, V::f b) { return _mm512_max_ps(a, b); }  // maxps returns b where a lane is NaN
inline float hmax(V::f a) { return _mm512_reduce_max_ps(a); }
#elif defined(HAL_ISA_AVX2)
constexpr int kAttnAcc = 8;
[[gnu::always_inline]] inline __m256 hsum4_lanes(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
}
[[gnu::always_inline]] inline void hsum_acc(const V::f *a, float *out) {
    __m256 s0 = hsum4_lanes(a[0], a[1], a[2], a[3]), s1 = hsum4_lanes(a[4], a[5], a[6], a[7]);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
}
inline V::f vmax(V::f a, V::f b) { return _mm256_max_ps(a, b); }
inline float hmax(V::f a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#else
constexpr int kAttnAcc = 8;
[[gnu::always_inline]] inline void hsum_acc(const V::f *a, float *out) {
    for (int i = 0; i < kAttnAcc; ++i) out[i] = V::hsum(a[i]);
}
inline V::f vmax(V::f a, V::f b) {
    for (int l = 0; l < 4; ++l) a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l];
    return a;
}
inline float hmax(V::f a) {
    float m = a.v[0];
    for (int l = 1; l < 4; ++l) m = a.v[l] > m ? a.v[l] : m;
    return m;
}
#endif
// ---------------------------------------------------------------------------------------------

}  // namespace hal

// ---------------------------------------------------------------------------------------------
// AVX512_VNNI variant: the avx512 vector layer above plus byte dot products (u8 x s8 -> int32).
// setup.py compiles it with HAL_ISA_AVX512 and HAL_ISA_VNNI; only the W8A8 kernels use VI.
// ---------------------------------------------------------------------------------------------
#if defined(HAL_ISA_AVX512) && defined(HAL_ISA_VNNI)
#undef HAL_ISA_NAME
#define HAL_ISA_NAME avx512vnni
namespace hal {
struct VI {
    using i = __m512i;
    static i zero() { return _mm512_setzero_si512(); }
    // acc[j] += sum over t < 4 of u[4j + t] * s[4j + t] (u unsigned bytes, s signed bytes; exact in int32).
    // (In place through asm: GCC 12 copies the accumulator around the intrinsic, two moves per product.)
    static i dot(i acc, i u, i s) {
#if defined(__GNUC__) && !defined(__clang__)
        __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
        return acc;
#else
        return _mm512_dpbusd_epi32(acc, u, s);
#endif
    }
    // Four consecutive signed bytes broadcast to every 32-bit lane.
    static i bcast4(const int8_t *p) {
        int32_t v;
        std::memcpy(&v, p, 4);
        return _mm512_set1_epi32(v);
    }
    // Bytes [0, count) of p; the rest zero (never read, so a short tail cannot fault).
    static i load_bytes(const uint8_t *p, int64_t count) {
        if (count >= 64) return _mm512_loadu_si512(p);
        return _mm512_maskz_loadu_epi8(count <= 0 ? 0 : (~__mmask64(0) >> (64 - count)), p);
    }
    // Rows r0..r3 (64 columns of one byte each) to four vectors in dot-product layout: out[v] holds
    // columns 16v .. 16v + 15, each 32-bit lane the bytes (r0[c], r1[c], r2[c], r3[c]).
    static void interleave4(i r0, i r1, i r2, i r3, i out[4]) {
        const i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
        const i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
        // u[j], 128-bit block L: columns 16L + 4j .. 16L + 4j + 3.
        const i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
        const i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
        transpose_blocks(u0, u1, u2, u3, out);
    }
    // The 4 x 4 transpose of 128-bit blocks: out[L] block j = a_j block L.
    static void transpose_blocks(i a0, i a1, i a2, i a3, i out[4]) {
        const i s0 = _mm512_shuffle_i32x4(a0, a1, 0x44), s1 = _mm512_shuffle_i32x4(a0, a1, 0xEE);
        const i s2 = _mm512_shuffle_i32x4(a2, a3, 0x44), s3 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
        out[0] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        out[1] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        out[2] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        out[3] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
};
}  // namespace hal
#endif
