// Helpers for the quantised GEMM paths: weight dequantisation (large-M path),
// per-row activation quantisation (W8A8), the ordered sum of a split-K GEMM's
// fp32 partials and the fp32 -> dtype cast.  Defines: HAL_DTYPE (0 f32, 1 f16, 2 bf16).  See README.md.
#include "hal_common.cuh"

#define HAL_UTIL_THREADS 256

// Stores 4 consecutive values of HAL_DTYPE (address 8-byte aligned for 16-bit
// types, 16-byte aligned for f32).
HAL_DEVICE void store4(hal_t* p, const float* v) {
#if HAL_DTYPE == HAL_F32
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
#else
    hal_vec8 o;
    o.x = (hal_u32)hal_from_float(v[0]) | ((hal_u32)hal_from_float(v[1]) << 16);
    o.y = (hal_u32)hal_from_float(v[2]) | ((hal_u32)hal_from_float(v[3]) << 16);
    *reinterpret_cast<hal_vec8*>(p) = o;
#endif
}

HAL_DEVICE void load_scales4(const hal_u16* scales, hal_i64 i, float* s) {
    const hal_vec8 sv = *reinterpret_cast<const hal_vec8*>(scales + i);
    s[0] = hal_half_to_float(static_cast<hal_u16>(sv.x & 0xffffu));
    s[1] = hal_half_to_float(static_cast<hal_u16>(sv.x >> 16));
    s[2] = hal_half_to_float(static_cast<hal_u16>(sv.y & 0xffffu));
    s[3] = hal_half_to_float(static_cast<hal_u16>(sv.y >> 16));
}

// w[K, N] = (q - z) * s for packed int4 weights.  One thread per packed word
// quad (8 rows x 4 columns); grid-stride over (K / 8) * (N / 4) items.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_w4a16_dequant(hal_t* HAL_RESTRICT w, const hal_u32* HAL_RESTRICT qweight,
                  const hal_u16* HAL_RESTRICT scales, const hal_u8* HAL_RESTRICT zeros, int K,
                  int N, int group_size) {
    const int quads = N / 4;
    const hal_i64 total = (hal_i64)(K / 8) * quads;
    for (hal_i64 i = (hal_i64)blockIdx.x * HAL_UTIL_THREADS + threadIdx.x; i < total;
         i += (hal_i64)gridDim.x * HAL_UTIL_THREADS) {
        const hal_i64 r = i / quads;
        const int n = (int)(i - r * quads) * 4;
        const hal_i64 g = r * 8 / group_size;
        float s[4];
        load_scales4(scales, g * N + n, s);
        hal_u32 zw = 0x08080808u;
        if (zeros) zw = *reinterpret_cast<const hal_u32*>(zeros + g * N + n);
        const hal_vec16 qv = hal_load16(qweight + r * N + n);
        const hal_u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float v[4];
#pragma unroll
            for (int c = 0; c < 4; ++c)
                v[c] = (float)((int)((qw[c] >> (4 * j)) & 15u) - (int)((zw >> (8 * c)) & 0xffu)) * s[c];
            store4(w + (r * 8 + j) * N + n, v);
        }
    }
}

// w[K, N] = (q - z) * s for uint8 weights (z = 128 when zeros is null).
// One thread per 4 columns of one row; grid-stride over K * (N / 4) items.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_w8_dequant(hal_t* HAL_RESTRICT w, const hal_u8* HAL_RESTRICT qweight,
               const hal_u16* HAL_RESTRICT scales, const hal_u8* HAL_RESTRICT zeros, int K, int N,
               int group_size) {
    const int quads = N / 4;
    const hal_i64 total = (hal_i64)K * quads;
    for (hal_i64 i = (hal_i64)blockIdx.x * HAL_UTIL_THREADS + threadIdx.x; i < total;
         i += (hal_i64)gridDim.x * HAL_UTIL_THREADS) {
        const hal_i64 k = i / quads;
        const int n = (int)(i - k * quads) * 4;
        const hal_i64 g = k / group_size;
        float s[4];
        load_scales4(scales, g * N + n, s);
        hal_u32 zw = 0x80808080u;
        if (zeros) zw = *reinterpret_cast<const hal_u32*>(zeros + g * N + n);
        const hal_u32 q = *reinterpret_cast<const hal_u32*>(qweight + k * N + n);
        float v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c)
            v[c] = (float)((int)((q >> (8 * c)) & 0xffu) - (int)((zw >> (8 * c)) & 0xffu)) * s[c];
        store4(w + k * N + n, v);
    }
}

// Exact float -> double without a float operation on a subnormal (flush-to-zero builds
// flush f32 operands, never f64 ones): a subnormal is its integer mantissa times 2^-149.
HAL_DEVICE double hal_f32_to_f64_exact(float f) {
    const hal_u32 b = hal_float_to_bits(f);
    if ((b & 0x7f800000u) != 0) return (double)f;
    const double mag = (double)(b & 0x007fffffu) * 0x1p-149;
    return (b >> 31) ? -mag : mag;
}

// max(amax / 127, smallest subnormal) rounded to float as IEEE division would, given amax's bits;
// 1 for amax = 0, NaN for a NaN or infinite amax.  Below 127 * 2^-126 (bits 0x03fe0000) the quotient is
// subnormal and is computed in integers (amax = N * 2^-149, result = RNE(N / 127) * 2^-149), so
// flush-to-zero can neither flush it nor its floor.
HAL_DEVICE float w8_row_scale(hal_u32 amax_bits) {
    if (amax_bits == 0) return 1.f;
    if (amax_bits >= 0x7f800000u) return hal_bits_to_float(0x7fc00000u);  // NaN or +-inf in the row
    if (amax_bits >= 0x03fe0000u) return hal_bits_to_float(amax_bits) / 127.f;
    const hal_u32 e = amax_bits >> 23, mant = amax_bits & 0x007fffffu;
    const unsigned long long n = e == 0 ? mant : (unsigned long long)(0x00800000u | mant) << (e - 1);
    unsigned long long q = n / 127u;
    if (2u * (n % 127u) > 127u) ++q;  // round to nearest (a tie cannot occur: 127 is odd)
    return hal_bits_to_float(q == 0 ? 1u : (hal_u32)q);
}

// Per-row symmetric int8 quantisation, bit for bit as hal_core.quant.quantize_activations:
// sx[m] = max(max|x[m, :]| / 127, smallest subnormal) (1 for an all-zero row),
// xq[m, k] = clamp(rint(x[m, k] / sx[m]), -127, 127) (round half to even). A true division, not a
// multiplication by 127 / max: the two round differently when x / sx lies next to a half. A row
// holding NaN or an infinity gets sx = NaN and xq = 0 (its W8A8 output row is NaN).
// Flush-to-zero safe: max|x| is an integer maximum of magnitude bits (NaN and inf bits are above
// every finite value's), the scale comes from w8_row_scale, and a division with a subnormal
// operand is done in double (the float32 quotient rounded from the double one is the correctly
// rounded float32 quotient).  Grid (M), block HAL_UTIL_THREADS.  W4A8_ORDER: column k of x goes to
// column w4a8_column(k) of xq (below), else to column k.
constexpr int QROW_WARPS = HAL_UTIL_THREADS / HAL_WARP_SIZE;

// The column of hal_w4a8_gemm_tc's A operand that holds activation column k: within each 32-column block
// (one k-block), k = 16 a + 8 h + 2 t + e goes to 16 h + 4 t + 2 e + a, so that the int8 MMA's k positions
// 4t..4t+3 and 16+4t..16+4t+3 of lane t meet the weights that lane's int4 record holds (README.md, "W4A8").
HAL_DEVICE int w4a8_column(int k) {
    const int b = k & 31;
    return (k & ~31) | ((b & 8) << 1) | ((b & 6) << 1) | ((b & 1) << 1) | (b >> 4);
}

template <bool W4A8_ORDER>
HAL_DEVICE void quantize_row(hal_i8* HAL_RESTRICT xq, float* HAL_RESTRICT sx, const hal_t* HAL_RESTRICT x, int K,
                             hal_u32* s_red) {
    constexpr int NWARPS = QROW_WARPS;
    const int tid = threadIdx.x;
    const hal_t* xr = x + (hal_i64)blockIdx.x * K;
    hal_i8* qr = xq + (hal_i64)blockIdx.x * K;
    hal_u32 amax = 0;
    for (int k = tid; k < K; k += HAL_UTIL_THREADS) {
        const hal_u32 mag = hal_float_to_bits(hal_to_float(xr[k])) & 0x7fffffffu;
        amax = mag > amax ? mag : amax;
    }
#pragma unroll
    for (int m = HAL_WARP_SIZE / 2; m > 0; m >>= 1) {  // shuffles move the 32 bits unchanged
        const hal_u32 other = hal_float_to_bits(hal_shfl_xor(hal_bits_to_float(amax), m));
        amax = other > amax ? other : amax;
    }
    if (tid % HAL_WARP_SIZE == 0) s_red[tid / HAL_WARP_SIZE] = amax;
    hal_barrier();
    amax = s_red[0];
    for (int w = 1; w < NWARPS; ++w) amax = s_red[w] > amax ? s_red[w] : amax;
    const float scale = w8_row_scale(amax);
    const bool finite = amax < 0x7f800000u;
    const bool tiny_scale = (hal_float_to_bits(scale) & 0x7f800000u) == 0;
    if (tid == 0) sx[blockIdx.x] = scale;
    for (int k = tid; k < K; k += HAL_UTIL_THREADS) {
        const float v = hal_to_float(xr[k]);
        const bool tiny_v = (hal_float_to_bits(v) & 0x7f800000u) == 0;
        const float ratio = tiny_scale || tiny_v
                                ? (float)(hal_f32_to_f64_exact(v) / hal_f32_to_f64_exact(scale))
                                : v / scale;
        const float q = finite ? fminf(fmaxf(rintf(ratio), -127.f), 127.f) : 0.f;
        qr[W4A8_ORDER ? w4a8_column(k) : k] = static_cast<hal_i8>(static_cast<int>(q));
    }
}

HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_w8a8_quantize_rows(hal_i8* HAL_RESTRICT xq, float* HAL_RESTRICT sx,
                       const hal_t* HAL_RESTRICT x, int K) {
    __shared__ hal_u32 s_red[QROW_WARPS];
    quantize_row<false>(xq, sx, x, K, s_red);
}

// hal_w8a8_quantize_rows with each 32-column block of xq in the A order of hal_w4a8_gemm_tc
// (w4a8_column; K a multiple of 32).  Grid (M), block HAL_UTIL_THREADS.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_w4a8_quantize_rows(hal_i8* HAL_RESTRICT xq, float* HAL_RESTRICT sx,
                       const hal_t* HAL_RESTRICT x, int K) {
    __shared__ hal_u32 s_red[QROW_WARPS];
    quantize_row<true>(xq, sx, x, K, s_red);
}

// out[i] = ws[0][i] + ws[1][i] + ... + ws[splits - 1][i], added in that order and converted to
// HAL_DTYPE: the K splits' partials of hal_w4a16_gemm / hal_w8a8_gemm (ws [splits][count]), summed
// in a fixed order whatever the CTAs' schedule.  Grid-stride over count elements.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_f32_splits_to_dtype(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT ws, long long count, int splits) {
    for (hal_i64 i = (hal_i64)blockIdx.x * HAL_UTIL_THREADS + threadIdx.x; i < count;
         i += (hal_i64)gridDim.x * HAL_UTIL_THREADS) {
        float v = ws[i];
        for (int y = 1; y < splits; ++y) v += ws[(hal_i64)y * count + i];
        out[i] = hal_from_float(v);
    }
}

// out[i] = ws[i] converted to HAL_DTYPE; grid-stride over count elements.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_f32_to_dtype(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT ws, long long count) {
    for (hal_i64 i = (hal_i64)blockIdx.x * HAL_UTIL_THREADS + threadIdx.x; i < count;
         i += (hal_i64)gridDim.x * HAL_UTIL_THREADS)
        out[i] = hal_from_float(ws[i]);
}
