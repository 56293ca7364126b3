// Helpers for the quantised GEMM paths: weight dequantisation (large-M path),
// per-row activation quantisation (W8A8) and the fp32 -> dtype cast used after
// a split-K GEMM.  Defines: HAL_DTYPE (0 f32, 1 f16, 2 bf16).  See README.md.
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

// Per-row symmetric int8 quantisation, bit for bit as hal_core.quant.quantize_activations:
// sx[m] = max(max|x[m, :]| / 127, smallest subnormal) (1 for an all-zero row),
// xq[m, k] = clamp(rint(x[m, k] / sx[m]), -127, 127)
// (round half to even). A true division, not a multiplication by 127 / max: the two round
// differently when x / sx lies next to a half. A row holding NaN or an infinity gets sx = NaN
// and xq = 0 (its W8A8 output row is NaN): NaN counts as +inf in the max (fmaxf drops NaN).
// Grid (M), block HAL_UTIL_THREADS.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_w8a8_quantize_rows(hal_i8* HAL_RESTRICT xq, float* HAL_RESTRICT sx,
                       const hal_t* HAL_RESTRICT x, int K) {
    constexpr int NWARPS = HAL_UTIL_THREADS / HAL_WARP_SIZE;
    __shared__ float s_red[NWARPS];
    const int tid = threadIdx.x;
    const hal_t* xr = x + (hal_i64)blockIdx.x * K;
    hal_i8* qr = xq + (hal_i64)blockIdx.x * K;
    float amax = 0.f;
    const float inf = hal_bits_to_float(0x7f800000u);
    for (int k = tid; k < K; k += HAL_UTIL_THREADS) {
        const float a = fabsf(hal_to_float(xr[k]));
        amax = fmaxf(amax, a == a ? a : inf);
    }
    amax = hal_warp_max(amax);
    if (tid % HAL_WARP_SIZE == 0) s_red[tid / HAL_WARP_SIZE] = amax;
    hal_barrier();
    amax = s_red[0];
    for (int w = 1; w < NWARPS; ++w) amax = fmaxf(amax, s_red[w]);
    const bool finite = amax < inf;
    const float scale = amax > 0.f ? fmaxf(amax / 127.f, 1.40129846e-45f) : 1.f;
    if (tid == 0) sx[blockIdx.x] = finite ? scale : hal_bits_to_float(0x7fc00000u);
    for (int k = tid; k < K; k += HAL_UTIL_THREADS) {
        const float q = finite ? fminf(fmaxf(rintf(hal_to_float(xr[k]) / scale), -127.f), 127.f) : 0.f;
        qr[k] = static_cast<hal_i8>(static_cast<int>(q));
    }
}

// out[i] = ws[i] converted to HAL_DTYPE; grid-stride over count elements.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_UTIL_THREADS)
hal_f32_to_dtype(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT ws, long long count) {
    for (hal_i64 i = (hal_i64)blockIdx.x * HAL_UTIL_THREADS + threadIdx.x; i < count;
         i += (hal_i64)gridDim.x * HAL_UTIL_THREADS)
        out[i] = hal_from_float(ws[i]);
}
