// Small-M (decode) GEMM with quantised weights: out[M, N] = x[M, K] @ w[K, N].
//
// Defines: HAL_DTYPE (x/out dtype: 0 f32, 1 f16, 2 bf16), HAL_QBITS (4: W4A16,
// 8: W8A8), HAL_M_TILE (rows of x per CTA: 1, 2, 4, 8 or 16), optional
// HAL_KWARPS (warps per CTA splitting K, default 4).  See README.md.
#include "hal_common.cuh"

#ifndef HAL_KWARPS
#define HAL_KWARPS 4
#endif

namespace qg {

constexpr int WARP = HAL_WARP_SIZE;
constexpr int MT = HAL_M_TILE;
constexpr int KW = HAL_KWARPS;
constexpr int NT = KW * WARP;
constexpr int COLS = 4 * WARP;  // output columns per CTA, 4 per lane

// Scales (fp16) and zero points for the lane's 4 columns of group g.
HAL_DEVICE void load_group(const hal_u16* scales, const hal_u8* zeros, int default_zero,
                           hal_i64 gn, float* s, int* z) {
    const hal_vec8 sv = *reinterpret_cast<const hal_vec8*>(scales + gn);
    s[0] = hal_half_to_float(static_cast<hal_u16>(sv.x & 0xffffu));
    s[1] = hal_half_to_float(static_cast<hal_u16>(sv.x >> 16));
    s[2] = hal_half_to_float(static_cast<hal_u16>(sv.y & 0xffffu));
    s[3] = hal_half_to_float(static_cast<hal_u16>(sv.y >> 16));
    if (zeros) {
        const hal_u32 zw = *reinterpret_cast<const hal_u32*>(zeros + gn);
#pragma unroll
        for (int c = 0; c < 4; ++c) z[c] = (int)((zw >> (8 * c)) & 0xffu);
    } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) z[c] = default_zero;
    }
}

// Sums the per-warp partial results in shared memory (warp 0, 1, ... in order)
// and writes them: directly to out when gridDim.y == 1, else as this K split's
// partial to ws[blockIdx.y][M][N] (plain stores; hal_f32_splits_to_dtype adds
// the splits in order 0, 1, ...: no atomics, the same bits on every run).
HAL_DEVICE void store(float (*acc)[4], float (*s_red)[COLS], const float* row_scale,
                      hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, int m0, int M, int N) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    for (int w = 0; w < KW; ++w) {
        if (warp == w) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float& r = s_red[m][lane * 4 + c];
                    r = (w == 0 ? 0.f : r) + acc[m][c];
                }
        }
        hal_barrier();
    }
#pragma unroll 1  // unrolled, ptxas keeps more live values across the stores (spills on sm_90, HAL_M_TILE 2)
    for (int i = tid; i < MT * COLS; i += NT) {
        const int m = i / COLS, cc = i % COLS;
        const int n = blockIdx.x * COLS + cc;
        const int row = m0 + m;
        if (n >= N || row >= M) continue;
        float v = s_red[m][cc];
        if (row_scale) v = hal_mul_scale_ftz_safe(v, row_scale[row]);  // FTZ cannot drop a subnormal scale
        const hal_i64 o = (hal_i64)row * N + n;
        if (gridDim.y == 1)
            out[o] = hal_from_float(v);
        else
            ws[(hal_i64)blockIdx.y * M * N + o] = v;
    }
}

}  // namespace qg

#if HAL_QBITS == 4
// W4A16.  Grid (ceil(N / (4 * warp)), ksplit, ceil(M / HAL_M_TILE)); block
// HAL_KWARPS * warp threads.  CTA y handles groups [y * groups_per_split, ...).
// HAL_M_TILE 16 on CUDA: a minimum of CTAs per SM that fits the accumulators without spilling on sm_80,
// sm_90 and sm_120 (16-bit x: 4, 128 registers; fp32 x: 3). Without the hint ptxas spills on sm_120 (16-bit
// x: 128 registers, 104 bytes) or sm_90 (fp32 x: 40 bytes).
#if defined(HAL_CUDA) && HAL_M_TILE == 16
#define HAL_QG_W4_BOUNDS __launch_bounds__(qg::NT, HAL_DTYPE == HAL_F32 ? 3 : 4)
#else
#define HAL_QG_W4_BOUNDS HAL_LAUNCH_BOUNDS(qg::NT)
#endif
HAL_GLOBAL void HAL_QG_W4_BOUNDS
hal_w4a16_gemm(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, const hal_t* HAL_RESTRICT x,
               const hal_u32* HAL_RESTRICT qweight, const hal_u16* HAL_RESTRICT scales,
               const hal_u8* HAL_RESTRICT zeros, int M, int N, int K, int group_size,
               int groups_per_split) {
    using namespace qg;
    __shared__ float s_red[MT][COLS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.x * WARP + lane) * 4;
    const int m0 = blockIdx.z * MT;
    const int rows = M - m0 < MT ? M - m0 : MT;
    const int num_groups = K / group_size;
    const int g_begin = blockIdx.y * groups_per_split;
    const int g_end = g_begin + groups_per_split < num_groups ? g_begin + groups_per_split : num_groups;
    const int rows_per_group = group_size / 8;

    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;

    if (n < N) {
        for (int g = g_begin + warp; g < g_end; g += KW) {
            float s[4], zs[4];
            int z[4];
            load_group(scales, zeros, 8, (hal_i64)g * N + n, s, z);
#pragma unroll
            for (int c = 0; c < 4; ++c) zs[c] = -(float)z[c] * s[c];
#pragma unroll 4
            for (int r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
                const hal_vec16 qv = hal_load16(qweight + (hal_i64)r * N + n);
                const hal_u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
                float w[8][4];
#pragma unroll
                for (int c = 0; c < 4; ++c)
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        // Exact nibble -> float: 2^23 + q reinterpreted, minus 2^23.
                        const float q = hal_bits_to_float(0x4b000000u | ((qw[c] >> (4 * j)) & 15u)) - 8388608.f;
                        w[j][c] = q * s[c] + zs[c];
                    }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m >= rows) break;
                    const hal_t* xp = x + (hal_i64)(m0 + m) * K + r * 8;
                    float xf[8];
#if HAL_DTYPE == HAL_F32
                    hal_unpack16(hal_load16(xp), xf);
                    hal_unpack16(hal_load16(xp + 4), xf + 4);
#else
                    hal_unpack16(hal_load16(xp), xf);
#endif
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[m][c] += xf[j] * w[j][c];
                }
            }
        }
    }
    store(acc, s_red, nullptr, out, ws, m0, M, N);
}
#elif HAL_QBITS == 8
// W8A8.  xq int8 [M, K] and sx float [M] come from hal_w8a8_quantize_rows.
// Same grid/block rules as hal_w4a16_gemm.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(qg::NT)
hal_w8a8_gemm(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, const hal_i8* HAL_RESTRICT xq,
              const float* HAL_RESTRICT sx, const hal_u8* HAL_RESTRICT qweight,
              const hal_u16* HAL_RESTRICT scales, const hal_u8* HAL_RESTRICT zeros, int M, int N,
              int K, int group_size, int groups_per_split) {
    using namespace qg;
    __shared__ float s_red[MT][COLS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.x * WARP + lane) * 4;
    const int m0 = blockIdx.z * MT;
    const int rows = M - m0 < MT ? M - m0 : MT;
    const int num_groups = K / group_size;
    const int g_begin = blockIdx.y * groups_per_split;
    const int g_end = g_begin + groups_per_split < num_groups ? g_begin + groups_per_split : num_groups;

    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;

    if (n < N) {
        for (int g = g_begin + warp; g < g_end; g += KW) {
            float s[4];
            int z[4];
            load_group(scales, zeros, 128, (hal_i64)g * N + n, s, z);
            int iacc[MT][4], xsum[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                xsum[m] = 0;
#pragma unroll
                for (int c = 0; c < 4; ++c) iacc[m][c] = 0;
            }
#pragma unroll 2
            for (int k = g * group_size; k < (g + 1) * group_size; k += 4) {
                // Four rows of 4 columns, transposed to 4 k-values per column.
                hal_u32 r[4], col[4];
#pragma unroll
                for (int a = 0; a < 4; ++a)
                    r[a] = *reinterpret_cast<const hal_u32*>(qweight + (hal_i64)(k + a) * N + n);
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    col[c] = ((r[0] >> (8 * c)) & 0xffu) | (((r[1] >> (8 * c)) & 0xffu) << 8) |
                             (((r[2] >> (8 * c)) & 0xffu) << 16) | (((r[3] >> (8 * c)) & 0xffu) << 24);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m >= rows) break;
                    const int xa = *reinterpret_cast<const int*>(xq + (hal_i64)(m0 + m) * K + k);
                    xsum[m] = hal_dot4_s8u8(xa, 0x01010101u, xsum[m]);
#pragma unroll
                    for (int c = 0; c < 4; ++c) iacc[m][c] = hal_dot4_s8u8(xa, col[c], iacc[m][c]);
                }
            }
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[m][c] += s[c] * (float)(iacc[m][c] - z[c] * xsum[m]);
        }
    }
    store(acc, s_red, sx, out, ws, m0, M, N);
}
#else
#error "HAL_QBITS must be 4 or 8"
#endif
