// Quantised GEMM on tensor cores (warp matrix instructions of level 80, HAL_MMA_SYNC): out[M, N] = x[M, K] @ w[K, N].
//
// Defines: HAL_DTYPE (x/out: 1 f16, 2 bf16; the int8-activation kernels also 0 f32),
// HAL_QBITS (4: W4A16 with mma.m16n8k16, 8: W8A8 with mma.m16n8k32.s8),
// optional HAL_ABITS (8 with HAL_QBITS 4: W4A8, int4 weights times int8
// activations on mma.m16n8k32.s8; default 16 for HAL_QBITS 4, 8 for 8),
// HAL_M_FRAGS (16-row MMA fragments per CTA: 1, 2 or 4), optional HAL_STAGES
// (cp.async pipeline depth, default 4).  Weights come in the tensor-core layout that
// hal_cupy._tc_pack builds once per QuantizedWeight (see README.md, "Tensor-core
// weight layout"): for every 32-row k-block and 32-column group, one 16-byte
// (W4) or 32-byte (W8) record per lane, holding exactly that lane's B fragments
// of the group's four 8-column MMA tiles.  Columns are padded to a multiple of
// 128 (scales 0), so a CTA never reads past the arrays.
//
// Grid (Npad / 128, ksplit, ceil(M / (16 * HAL_M_FRAGS))), block 128 threads
// (4 warps x 32 columns).  CTA y covers k-blocks [y * kb_per_split, ...).
// ksplit == 1: the CTA writes out; otherwise it writes its float partial sums
// to ws[y][M][N] (plain stores) and hal_tc_reduce adds the splits in order 0,
// 1, ... -- no atomics, so every run gives the same bits.
//
// Per k-block a CTA stages (cp.async, zero-filled past M) its x rows, the
// weight records, and the k-block's group scales and zero points; each warp
// reads A with ldmatrix.x4, its 4 weight words with one 16-byte shared load,
// and runs 2 (W4A16) or 1 (W8A8, W4A8) MMA k-steps per fragment and tile.  MMAs of one
// quantisation group accumulate unscaled in float (W4A16: x * (q - z), exact
// products) or int32 (W8A8: xq * (q - 128); W4A8: xq * q); at the group's end the
// partial is scaled by the group scale (and, int8 activations, corrected for the
// zero point) into the float accumulator.
#include "hal_common.cuh"
#include "hal_mma.cuh"

#ifndef HAL_STAGES
#define HAL_STAGES 4
#endif
#ifndef HAL_ABITS
#if HAL_QBITS == 8
#define HAL_ABITS 8
#else
#define HAL_ABITS 16
#endif
#endif
#if !((HAL_QBITS == 4 && (HAL_ABITS == 16 || HAL_ABITS == 8)) || (HAL_QBITS == 8 && HAL_ABITS == 8))
#error "quant_gemm_tc.cu: HAL_QBITS / HAL_ABITS must be 4 / 16 (W4A16), 4 / 8 (W4A8) or 8 / 8 (W8A8)"
#endif
#if HAL_ABITS == 16 && HAL_DTYPE != HAL_F16 && HAL_DTYPE != HAL_BF16
#error "quant_gemm_tc.cu: W4A16 takes HAL_DTYPE 1 (f16) or 2 (bf16)"
#endif
#if HAL_DTYPE != HAL_F32 && HAL_DTYPE != HAL_F16 && HAL_DTYPE != HAL_BF16
#error "quant_gemm_tc.cu: HAL_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

// At least two CTAs per SM: without the hint ptxas caps some builds below what their
// accumulators need and spills (the host build ignores it).
#if defined(HAL_MMA_SYNC)
#define HAL_TC_LAUNCH_BOUNDS __launch_bounds__(128, 2)
#else
#define HAL_TC_LAUNCH_BOUNDS
#endif

namespace tc {

constexpr int THREADS = 128;
constexpr int COLS = 128;  // output columns per CTA: 4 warps x 4 tiles x 8
constexpr int KB = 32;     // k-block: rows of K per stage
constexpr int MF = HAL_M_FRAGS;
constexpr int MT = 16 * MF;  // rows of x per CTA
constexpr int STAGES = HAL_STAGES;
constexpr int A_ELEM = HAL_ABITS == 16 ? 2 : 1;            // bytes per staged x element (int8: xq)
constexpr int B_BYTES = HAL_QBITS == 4 ? COLS * KB / 2 : COLS * KB;  // 2048 (4 bits per weight) or 4096
constexpr int A_ROW = KB * A_ELEM;        // bytes of one staged x row
constexpr int A_STRIDE = A_ROW + 16;      // padded: 8 ldmatrix rows hit 8 distinct 16-byte bank groups
constexpr int A_BYTES = MT * A_STRIDE;
constexpr int S_BYTES = COLS * 2;         // fp16 scales of the k-block's group
constexpr int Z_BYTES = COLS;             // uint8 zero points
constexpr int B_OFF = 0, A_OFF = B_BYTES, S_OFF = A_OFF + A_BYTES, Z_OFF = S_OFF + S_BYTES;
constexpr int STAGE_BYTES = Z_OFF + Z_BYTES;
constexpr int B_CHUNKS = B_BYTES / 16, A_CHUNKS_ROW = A_ROW / 16, A_CHUNKS = MT * A_CHUNKS_ROW;
constexpr int S_CHUNKS = S_BYTES / 16, Z_CHUNKS = Z_BYTES / 16;

// Issues the cp.async copies of k-block kb (of quantisation group g) into one stage: every
// thread copies fixed 16-byte chunks (unrolled, no division).
HAL_DEVICE void load_stage(hal_u8* stage, const hal_u8* qtc, const hal_u8* x, const hal_u16* scales,
                           const hal_u8* zeros, int kb, int g, int m0, int M, int K, int npad) {
    const int tid = threadIdx.x, ct = blockIdx.x;
    const hal_u8* bsrc = qtc + ((hal_i64)kb * npad + (hal_i64)ct * COLS) * (B_BYTES / COLS);
#pragma unroll
    for (int i = 0; i < B_CHUNKS / THREADS; ++i)
        hal_cp_async_cg16(stage + B_OFF + 16 * (tid + i * THREADS), bsrc + 16 * (tid + i * THREADS), 16);
#pragma unroll
    for (int i = 0; i < (A_CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = tid + i * THREADS;
        if (A_CHUNKS % THREADS == 0 || c < A_CHUNKS) {
            const int r = c / A_CHUNKS_ROW, part = c % A_CHUNKS_ROW;  // powers of two
            const bool valid = m0 + r < M;
            const hal_u8* src =
                valid ? x + ((hal_i64)(m0 + r) * K + (hal_i64)kb * KB) * A_ELEM + 16 * part : x;
            hal_cp_async_cg16(stage + A_OFF + r * A_STRIDE + 16 * part, src, valid ? 16 : 0);
        }
    }
    const hal_i64 col0 = (hal_i64)g * npad + (hal_i64)ct * COLS;
    if (tid < S_CHUNKS) hal_cp_async_cg16(stage + S_OFF + 16 * tid, scales + col0 + 8 * tid, 16);
    if (zeros && tid >= S_CHUNKS && tid < S_CHUNKS + Z_CHUNKS)
        hal_cp_async_cg16(stage + Z_OFF + 16 * (tid - S_CHUNKS), zeros + col0 + 16 * (tid - S_CHUNKS), 16);
}

// log2 of the k-blocks per quantisation group (group sizes are powers of two).
HAL_DEVICE int group_shift(int group_size) {
    int shift = 0;
    while ((KB << shift) < group_size) ++shift;
    return shift;
}

HAL_DEVICE float stage_scale(const hal_u8* stage, int col) {
    return hal_half_to_float(*reinterpret_cast<const hal_u16*>(stage + S_OFF + 2 * col));
}

#if HAL_ABITS == 16
// int4 -> 16-bit (q - z) pairs for the B fragments of two k16 steps.  Word
// nibble p (p = 0..3) and p + 4 hold the two rows of pair p = (step p / 2,
// register p % 2).  f16: (w & 0x000f000f) | 0x64006400 is the pair 1024 + q
// (bits 4..7: 1024 + 16 q), so one LOP3 per pair, one shift per word and one
// HSUB2/HFMA2 per pair subtracting 1024 + z: 9 instructions per 8 weights.
// bf16 (7 mantissa bits): 0x43004300 gives 128 + q for bits 0..3 only, so
// three shifts: 11 per 8 weights.  Every result is exact.
HAL_DEVICE void decode_w4(hal_u32 w, hal_u32 zlo, hal_u32 zhi, hal_u32 (*b)[2]) {
#if HAL_DTYPE == HAL_F16
    const hal_u32 w8 = w >> 8;
    const hal_u32 sixteenth = 0x2c002c00u;  // 1/16 in both halves
    b[0][0] = hal_sub_f16x2(hal_and_or(w, 0x000f000fu, 0x64006400u), zlo);
    b[0][1] = hal_fma_f16x2(hal_and_or(w, 0x00f000f0u, 0x64006400u), sixteenth, zhi);
    b[1][0] = hal_sub_f16x2(hal_and_or(w8, 0x000f000fu, 0x64006400u), zlo);
    b[1][1] = hal_fma_f16x2(hal_and_or(w8, 0x00f000f0u, 0x64006400u), sixteenth, zhi);
#else
    const hal_u32 one = 0x3f803f80u;
    b[0][0] = hal_fma_bf16x2(hal_and_or(w, 0x000f000fu, 0x43004300u), one, zlo);
    b[0][1] = hal_fma_bf16x2(hal_and_or(w >> 4, 0x000f000fu, 0x43004300u), one, zlo);
    b[1][0] = hal_fma_bf16x2(hal_and_or(w >> 8, 0x000f000fu, 0x43004300u), one, zlo);
    b[1][1] = hal_fma_bf16x2(hal_and_or(w >> 12, 0x000f000fu, 0x43004300u), one, zlo);
    (void)zhi;
#endif
}

// The subtrahends of decode_w4 for zero point z, in both halves.
HAL_DEVICE void zero_terms(int z, hal_u32* zlo, hal_u32* zhi) {
#if HAL_DTYPE == HAL_F16
    const hal_u32 lo = 0x6400u | (hal_u32)z;  // 1024 + z (exact: ulp 1 in [1024, 2048))
    const hal_u32 hi = hal_float_to_half(-(64.f + (float)z));
    *zlo = lo | (lo << 16);
    *zhi = hi | (hi << 16);
#else
    const hal_u32 lo = hal_float_to_bf16(-(128.f + (float)z));
    *zlo = lo | (lo << 16);
    *zhi = 0;
#endif
}

HAL_DEVICE void mma16(float* d, const hal_u32* a, const hal_u32* b) {
#if HAL_DTYPE == HAL_F16
    hal_mma_m16n8k16_f16(d, a, b, d);
#else
    hal_mma_m16n8k16_bf16(d, a, b, d);
#endif
}
#else
// The B fragments of the k-block's four 8-column tiles, as int8, and the zero point's offset zc: the group's
// int32 partial plus zc * (the row's sum of xq) is sum_k xq (q - z).
// W8A8: the record (32 bytes per lane) holds q - 128, so zc = 128 - z.  W4A8: the lane's W4A16 record word j
// holds nibble p + 4e at k = 16 (p / 2) + 8 (p % 2) + 2 t + e; its even nibbles (w & 0x0f0f0f0f: k = 2t, 16+2t,
// 2t+1, 17+2t) form b[0] and its odd ones (w >> 4: k = 8+2t, 24+2t, 9+2t, 25+2t) b[1], codes q in [0, 15] with
// no subtraction (zc = -z) -- which is why hal_w4a8_quantize_rows stores xq in the matching k order.
HAL_DEVICE void load_b_s8(const hal_u8* stage, int warp, int lane, hal_u32 (*b)[2]) {
#if HAL_QBITS == 8
    const hal_vec16* bw = reinterpret_cast<const hal_vec16*>(stage + B_OFF + 32 * (warp * 32 + lane));
    const hal_vec16 w01 = bw[0], w23 = bw[1];
    b[0][0] = w01.x, b[0][1] = w01.y, b[1][0] = w01.z, b[1][1] = w01.w;
    b[2][0] = w23.x, b[2][1] = w23.y, b[3][0] = w23.z, b[3][1] = w23.w;
#else
    const hal_vec16 words = *reinterpret_cast<const hal_vec16*>(stage + B_OFF + 16 * (warp * 32 + lane));
    const hal_u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        b[j][0] = w[j] & 0x0f0f0f0fu;
        b[j][1] = (w[j] >> 4) & 0x0f0f0f0fu;
    }
#endif
}

HAL_DEVICE int zero_offset(const hal_u8* stage, const hal_u8* zeros, int col) {
#if HAL_QBITS == 8
    return 128 - (zeros ? (int)stage[Z_OFF + col] : 128);
#else
    return -(zeros ? (int)stage[Z_OFF + col] : 8);
#endif
}
#endif  // HAL_ABITS

// Writes the CTA's results: to out when ksplit == 1, else to its ws slice.
HAL_DEVICE void store(float (*acc)[4][4], const float* sx, hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws,
                      int m0, int M, int N) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane >> 2, tig = lane & 3;
    const int n_base = blockIdx.x * COLS + warp * 32;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = m0 + mf * 16 + group + 8 * (i >> 1);
                const int col = n_base + j * 8 + 2 * tig + (i & 1);
                if (row >= M || col >= N) continue;
                float v = acc[mf][j][i];
                if (sx) v = hal_mul_scale_ftz_safe(v, sx[row]);  // flush-to-zero cannot drop a subnormal sx
                if (gridDim.y == 1)
                    out[(hal_i64)row * N + col] = hal_from_float(v);
                else
                    ws[((hal_i64)blockIdx.y * M + row) * N + col] = v;
            }
}

}  // namespace tc

#if HAL_ABITS == 16
// W4A16.  qtc: the packed records; scales fp16 [K / G, npad]; zeros uint8
// [K / G, npad] or null (zero point 8).
HAL_GLOBAL void HAL_TC_LAUNCH_BOUNDS
hal_w4a16_gemm_tc(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, const hal_t* HAL_RESTRICT x,
                  const hal_u32* HAL_RESTRICT qtc, const hal_u16* HAL_RESTRICT scales,
                  const hal_u8* HAL_RESTRICT zeros, int M, int N, int K, int group_size, int kb_per_split) {
    using namespace tc;
    alignas(16) __shared__ hal_u8 smem[STAGES][STAGE_BYTES];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane >> 2, tig = lane & 3;
    const int npad = gridDim.x * COLS;
    const int m0 = blockIdx.z * MT;
    const int kblocks = K / KB, gshift = group_shift(group_size), kpg_mask = (1 << gshift) - 1;
    const int kb_begin = blockIdx.y * kb_per_split;
    const int kb_end = kb_begin + kb_per_split < kblocks ? kb_begin + kb_per_split : kblocks;
    const hal_u8* xb = reinterpret_cast<const hal_u8*>(x);
    const hal_u8* qb = reinterpret_cast<const hal_u8*>(qtc);

    float acc[MF][4][4], part[MF][4][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mf][j][i] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (kb_begin + s < kb_end)
            load_stage(smem[s], qb, xb, scales, zeros, kb_begin + s, (kb_begin + s) >> gshift, m0, M, K, npad);
        hal_cp_async_commit();
    }
    hal_u32 zlo[4], zhi[4];
    for (int kb = kb_begin; kb < kb_end; ++kb) {
        hal_cp_async_wait<STAGES - 2>();
        hal_barrier();
        {
            const int next = kb + STAGES - 1;
            if (next < kb_end)
                load_stage(smem[(next - kb_begin) % STAGES], qb, xb, scales, zeros, next, next >> gshift, m0, M,
                           K, npad);
            hal_cp_async_commit();
        }
        const hal_u8* stage = smem[(kb - kb_begin) % STAGES];
        const bool first = kb == kb_begin || (kb & kpg_mask) == 0;
        const bool last = kb + 1 == kb_end || ((kb + 1) & kpg_mask) == 0;
        if (first) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int z = zeros ? (int)stage[Z_OFF + warp * 32 + j * 8 + group] : 8;
                zero_terms(z, &zlo[j], &zhi[j]);
            }
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) part[mf][j][i] = 0.f;
        }
        hal_u32 a[2][MF][4];
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
                hal_ldmatrix_x4(a[s][mf], stage + A_OFF + (mf * 16 + lane % 16) * A_STRIDE +
                                              (s * 16 + 8 * (lane / 16)) * A_ELEM);
        const hal_vec16 words = *reinterpret_cast<const hal_vec16*>(stage + B_OFF + 16 * (warp * 32 + lane));
        const hal_u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            hal_u32 b[2][2];
            decode_w4(w[j], zlo[j], zhi[j], b);
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int mf = 0; mf < MF; ++mf) mma16(part[mf][j], a[s][mf], b[s]);
        }
        if (last) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float s0 = stage_scale(stage, warp * 32 + j * 8 + 2 * tig);
                const float s1 = stage_scale(stage, warp * 32 + j * 8 + 2 * tig + 1);
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[mf][j][i] += ((i & 1) ? s1 : s0) * part[mf][j][i];
            }
        }
    }
    hal_cp_async_wait_all();
    store(acc, nullptr, out, ws, m0, M, N);
}
#else
namespace tc {
// The int8-activation GEMM (W8A8 and W4A8): xq int8 [M, K] and sx float [M] from
// hal_w8a8_quantize_rows / hal_w4a8_quantize_rows; qtc: the packed records (load_b_s8); scales fp16 and
// zeros uint8 (or null: zero point 128 (W8), 8 (W4)) [K / G, npad].  Per group and output:
// sum_k xq (q - z) = part + zc * rowsum in int32 (exact), the row sums taken by one more MMA against a B of
// ones; then acc += scale * (float)(that sum), and at the end out = acc * sx[row].
HAL_DEVICE void gemm_s8(hal_u8 (*smem)[STAGE_BYTES], hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws,
                        const hal_i8* HAL_RESTRICT xq, const float* HAL_RESTRICT sx, const hal_u32* HAL_RESTRICT qtc,
                        const hal_u16* HAL_RESTRICT scales, const hal_u8* HAL_RESTRICT zeros, int M, int N, int K,
                        int group_size, int kb_per_split) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, tig = lane & 3;
    const int npad = gridDim.x * COLS;
    const int m0 = blockIdx.z * MT;
    const int kblocks = K / KB, gshift = group_shift(group_size), kpg_mask = (1 << gshift) - 1;
    const int kb_begin = blockIdx.y * kb_per_split;
    const int kb_end = kb_begin + kb_per_split < kblocks ? kb_begin + kb_per_split : kblocks;
    const hal_u8* xb = reinterpret_cast<const hal_u8*>(xq);
    const hal_u8* qb = reinterpret_cast<const hal_u8*>(qtc);
    const hal_u32 ones[2] = {0x01010101u, 0x01010101u};

    float acc[MF][4][4];
    int part[MF][4][4], rowsum[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mf][j][i] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (kb_begin + s < kb_end)
            load_stage(smem[s], qb, xb, scales, zeros, kb_begin + s, (kb_begin + s) >> gshift, m0, M, K, npad);
        hal_cp_async_commit();
    }
    for (int kb = kb_begin; kb < kb_end; ++kb) {
        hal_cp_async_wait<STAGES - 2>();
        hal_barrier();
        {
            const int next = kb + STAGES - 1;
            if (next < kb_end)
                load_stage(smem[(next - kb_begin) % STAGES], qb, xb, scales, zeros, next, next >> gshift, m0, M,
                           K, npad);
            hal_cp_async_commit();
        }
        const hal_u8* stage = smem[(kb - kb_begin) % STAGES];
        const bool first = kb == kb_begin || (kb & kpg_mask) == 0;
        const bool last = kb + 1 == kb_end || ((kb + 1) & kpg_mask) == 0;
        if (first) {
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    rowsum[mf][i] = 0;
#pragma unroll
                    for (int j = 0; j < 4; ++j) part[mf][j][i] = 0;
                }
        }
        hal_u32 a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
            hal_ldmatrix_x4(a[mf], stage + A_OFF + (mf * 16 + lane % 16) * A_STRIDE + 16 * (lane / 16));
        hal_u32 b[4][2];
        load_b_s8(stage, warp, lane, b);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
            hal_mma_m16n8k32_s8(rowsum[mf], a[mf], ones, rowsum[mf]);
#pragma unroll
            for (int j = 0; j < 4; ++j) hal_mma_m16n8k32_s8(part[mf][j], a[mf], b[j], part[mf][j]);
        }
        if (last) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = warp * 32 + j * 8 + 2 * tig + h;
                    const float s = stage_scale(stage, col);
                    const int zc = zero_offset(stage, zeros, col);
#pragma unroll
                    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int i = 2 * r + h;
                            acc[mf][j][i] += s * (float)(part[mf][j][i] + zc * rowsum[mf][i]);
                        }
                }
        }
    }
    hal_cp_async_wait_all();
    store(acc, sx, out, ws, m0, M, N);
}
}  // namespace tc

#if HAL_QBITS == 8
// W8A8: int8 weights (records of q - 128), activations from hal_w8a8_quantize_rows (tc::gemm_s8).
HAL_GLOBAL void HAL_TC_LAUNCH_BOUNDS
hal_w8a8_gemm_tc(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, const hal_i8* HAL_RESTRICT xq,
                 const float* HAL_RESTRICT sx, const hal_u32* HAL_RESTRICT qtc, const hal_u16* HAL_RESTRICT scales,
                 const hal_u8* HAL_RESTRICT zeros, int M, int N, int K, int group_size, int kb_per_split) {
    alignas(16) __shared__ hal_u8 smem[tc::STAGES][tc::STAGE_BYTES];
    tc::gemm_s8(smem, out, ws, xq, sx, qtc, scales, zeros, M, N, K, group_size, kb_per_split);
}
#else
// W4A8: int4 weights (the W4A16 records), activations from hal_w4a8_quantize_rows in its k order (tc::gemm_s8).
HAL_GLOBAL void HAL_TC_LAUNCH_BOUNDS
hal_w4a8_gemm_tc(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT ws, const hal_i8* HAL_RESTRICT xq,
                 const float* HAL_RESTRICT sx, const hal_u32* HAL_RESTRICT qtc, const hal_u16* HAL_RESTRICT scales,
                 const hal_u8* HAL_RESTRICT zeros, int M, int N, int K, int group_size, int kb_per_split) {
    alignas(16) __shared__ hal_u8 smem[tc::STAGES][tc::STAGE_BYTES];
    tc::gemm_s8(smem, out, ws, xq, sx, qtc, scales, zeros, M, N, K, group_size, kb_per_split);
}
#endif
#endif  // HAL_ABITS

// out = sum over y of ws[y] (in the order y = 0, 1, ...), converted to HAL_DTYPE.
// Grid-stride over count = M * N elements; any grid, 128-thread blocks.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(tc::THREADS)
hal_tc_reduce(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT ws, hal_i64 count, int splits) {
    for (hal_i64 i = (hal_i64)blockIdx.x * tc::THREADS + threadIdx.x; i < count;
         i += (hal_i64)gridDim.x * tc::THREADS) {
        float v = ws[i];
        for (int y = 1; y < splits; ++y) v += ws[(hal_i64)y * count + i];
        out[i] = hal_from_float(v);
    }
}
