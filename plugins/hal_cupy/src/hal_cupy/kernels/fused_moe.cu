// Mixture-of-experts layer (hal-core's fused_moe) in five steps, with no host read between them.
//
// Defines: HAL_DTYPE (hidden_states/out dtype: 0 f32, 1 f16, 2 bf16), HAL_QBITS (4: int4 experts,
// 8: int8 experts, W8A8), HAL_ABITS (int4 experts' activations: 16, the default, W4A16; 8: W4A8, the
// hidden states and the gated intermediate quantised per row as for W8A8), HAL_WARP_SIZE, optional
// HAL_MOE_TILE (rows per GEMM tile, default 8) and HAL_KWARPS (warps per GEMM CTA splitting K, default 4).
// See README.md.
//
// 1. hal_moe_route: each token's top_k experts (ties: lowest index; NaN logits rank last) and their
//    float32 weights; per-expert counts by integer atomics (the counts are exact whatever the order).
// 2. hal_moe_align (one CTA): each expert's rows padded to HAL_MOE_TILE (offsets, an exclusive scan),
//    the expert of every row tile, -1 in every row slot and past the last tile.
// 3. hal_moe_scatter: every (token, slot) pair written to a row slot of its expert.  The order within an
//    expert follows the atomics' schedule; each row's result is computed alone, so it does not matter.
// 4. hal_moe_w{4,8,4a8}_gate_up then hal_moe_w{4,8,4a8}_down: grouped GEMMs, CTA (tile, column block) multiplies
//    one tile of one expert's rows by that expert's weights (read once per tile); surplus tiles of the
//    worst-case grid exit after reading the padded total.  gate_up writes the gated intermediate
//    act(gate) * up in float32 (padding rows: 0); down writes each pair's float32 row.
// 5. hal_moe_combine: out[t] = sum_j w[t, j] * y[t * top_k + j] in slot order, float32, rounded once.
//
// Expert weights come as a table of addresses, 3 per expert (qweight, scales, zeros or 0).
#include "hal_common.cuh"

#ifndef HAL_MOE_TILE
#define HAL_MOE_TILE 8
#endif
#ifndef HAL_KWARPS
#define HAL_KWARPS 4
#endif
#ifndef HAL_ABITS
#define HAL_ABITS 16
#endif
// Whether the GEMMs take int8 activations (W8A8, W4A8) or float ones (W4A16).
#if HAL_QBITS == 8 || (HAL_QBITS == 4 && HAL_ABITS == 8)
#define HAL_MOE_INT8_ACTIVATIONS 1
#elif HAL_QBITS == 4 && HAL_ABITS == 16
#define HAL_MOE_INT8_ACTIVATIONS 0
#else
#error "HAL_QBITS must be 4 or 8, and HAL_ABITS 16 or (int4 experts) 8"
#endif
#define HAL_MOE_ALIGN_THREADS 256

namespace moe {

constexpr int WARP = HAL_WARP_SIZE;
constexpr int MT = HAL_MOE_TILE;
constexpr int KW = HAL_KWARPS;
constexpr int NT = KW * WARP;
constexpr int COLS = 4 * WARP;  // output columns per CTA, 4 per lane

HAL_DEVICE int fetch_add(int* p, int v) {
#ifdef HAL_HOST
    const int old = *p;  // host threads are fibers that switch only at barriers and shuffles
    *p = old + v;
    return old;
#else
    return atomicAdd(p, v);
#endif
}

HAL_DEVICE bool is_nan(float v) { return (hal_float_to_bits(v) & 0x7fffffffu) > 0x7f800000u; }

// Whether expert a (logit va) ranks before expert b: descending logit, NaN as the lowest, ties to the lowest index
// (the reference's sort key (-logit or +inf for NaN, index)).
HAL_DEVICE bool before(float va, int a, float vb, int b) {
    const float ka = is_nan(va) ? hal_bits_to_float(0x7f800000u) : -va;
    const float kb = is_nan(vb) ? hal_bits_to_float(0x7f800000u) : -vb;
    return ka < kb || (ka == kb && a < b);
}

HAL_DEVICE float act(float g, int activation) {
    if (activation == 1) return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    if (activation == 2) return 0.5f * g * (1.f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
    return g / (1.f + expf(-g));
}

// Scales (fp16) and zero points of 4 columns at gn.
HAL_DEVICE void load_group(const hal_u16* scales, const hal_u8* zeros, int default_zero, hal_i64 gn, float* s,
                           int* z) {
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

// The tile's expert weights from the address table.
struct Expert {
    const void* qweight;
    const hal_u16* scales;
    const hal_u8* zeros;
};

HAL_DEVICE Expert expert_of(const hal_i64* table, int e) {
    Expert x;
    x.qweight = reinterpret_cast<const void*>(table[3 * e]);
    x.scales = reinterpret_cast<const hal_u16*>(table[3 * e + 1]);
    x.zeros = reinterpret_cast<const hal_u8*>(table[3 * e + 2]);
    return x;
}

// Sums the warps' partials (warp 0, 1, ... in order) into s_red[m][0, width): the same bits on every run.
template <int W>
HAL_DEVICE void reduce(float (*acc)[W], float (*s_red)[W * WARP]) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    for (int w = 0; w < KW; ++w) {
        if (warp == w) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int c = 0; c < W; ++c) {
                    float& r = s_red[m][(c / 4) * COLS + lane * 4 + c % 4];
                    r = (w == 0 ? 0.f : r) + acc[m][c];
                }
        }
        hal_barrier();
    }
}

#if !HAL_MOE_INT8_ACTIVATIONS
// acc[m][c] += x[m] . w[:, c] over one row of 8 packed k values (4 columns of one word each).
HAL_DEVICE void dequant8(const hal_u32* qw, const float* s, const float* zs, float (*w)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float q = hal_bits_to_float(0x4b000000u | ((qw[c] >> (4 * j)) & 15u)) - 8388608.f;
            w[j][c] = q * s[c] + zs[c];
        }
}
#endif

}  // namespace moe

// 1. One thread per token (grid-stride).  routing: 0 softmax_topk, 1 softmax_topk_renorm, 2 topk_softmax.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_MOE_ALIGN_THREADS)
hal_moe_route(int* HAL_RESTRICT topk_ids, float* HAL_RESTRICT topk_weights, int* HAL_RESTRICT counts,
              const float* HAL_RESTRICT logits, int num_tokens, int num_experts, int top_k, int routing) {
    using namespace moe;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        const float* row = logits + (hal_i64)t * num_experts;
        int* ids = topk_ids + (hal_i64)t * top_k;
        float* ws = topk_weights + (hal_i64)t * top_k;
        int prev = -1;
        bool picked_nan = false;
        for (int j = 0; j < top_k; ++j) {
            int best = -1;
            for (int e = 0; e < num_experts; ++e) {
                if (prev >= 0 && !before(row[prev], prev, row[e], e)) continue;  // already taken
                if (best < 0 || before(row[e], e, row[best], best)) best = e;
            }
            ids[j] = best;
            picked_nan = picked_nan || is_nan(row[best]);
            fetch_add(counts + best, 1);
            prev = best;
        }
        float top = row[ids[0]], sum = 0.f;
        if (routing == 2) {
            for (int j = 0; j < top_k; ++j) sum += expf(row[ids[j]] - top);
            for (int j = 0; j < top_k; ++j)
                ws[j] = picked_nan ? hal_bits_to_float(0x7fc00000u) : expf(row[ids[j]] - top) / sum;
            continue;
        }
        bool any_nan = false;
        for (int e = 0; e < num_experts; ++e) any_nan = any_nan || is_nan(row[e]);
        for (int e = 0; e < num_experts; ++e) sum += expf(row[e] - top);
        float picked = 0.f;
        for (int j = 0; j < top_k; ++j) {
            ws[j] = any_nan ? hal_bits_to_float(0x7fc00000u) : expf(row[ids[j]] - top) / sum;
            picked += ws[j];
        }
        if (routing == 1)
            for (int j = 0; j < top_k; ++j) ws[j] = ws[j] / picked;
    }
}

// 2. One CTA of HAL_MOE_ALIGN_THREADS.  offsets [num_experts + 1]: padded row offsets (offsets[num_experts]: the
// padded total); tile_expert [max_tiles]: each row tile's expert, -1 past the total; sorted_pairs
// [max_tiles * HAL_MOE_TILE] filled with -1; cursor [num_experts] zeroed for hal_moe_scatter.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_MOE_ALIGN_THREADS)
hal_moe_align(int* HAL_RESTRICT offsets, int* HAL_RESTRICT tile_expert, int* HAL_RESTRICT sorted_pairs,
              int* HAL_RESTRICT cursor, const int* HAL_RESTRICT counts, int num_experts, int max_tiles) {
    using namespace moe;
    const int tid = threadIdx.x;
    __shared__ int s_total;
    if (tid == 0) {
        int acc = 0;
        for (int e = 0; e < num_experts; ++e) {
            offsets[e] = acc;
            acc += (counts[e] + MT - 1) / MT * MT;
        }
        offsets[num_experts] = acc;
        s_total = acc;
    }
    hal_barrier();
    for (int e = tid; e < num_experts; e += HAL_MOE_ALIGN_THREADS) {
        cursor[e] = 0;
        const int first = offsets[e] / MT, tiles = (counts[e] + MT - 1) / MT;
        for (int i = 0; i < tiles; ++i) tile_expert[first + i] = e;
    }
    for (int i = s_total / MT + tid; i < max_tiles; i += HAL_MOE_ALIGN_THREADS) tile_expert[i] = -1;
    for (hal_i64 i = tid; i < (hal_i64)max_tiles * MT; i += HAL_MOE_ALIGN_THREADS) sorted_pairs[i] = -1;
}

// 3. One thread per (token, slot) pair p = token * top_k + slot.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_MOE_ALIGN_THREADS)
hal_moe_scatter(int* HAL_RESTRICT sorted_pairs, int* HAL_RESTRICT cursor, const int* HAL_RESTRICT topk_ids,
                const int* HAL_RESTRICT offsets, int num_pairs) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= num_pairs) return;
    const int e = topk_ids[p];
    sorted_pairs[offsets[e] + moe::fetch_add(cursor + e, 1)] = p;
}

#if !HAL_MOE_INT8_ACTIVATIONS
// 4a. W4A16 gate/up.  Grid (max_tiles, ceil(inter / (4 * warp))), block HAL_KWARPS * warp.  w13 [hidden, 2 * inter]
// per expert; act [max_tiles * HAL_MOE_TILE, inter] float32.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w4_gate_up(float* HAL_RESTRICT act, const hal_t* HAL_RESTRICT x, const int* HAL_RESTRICT sorted_pairs,
                   const int* HAL_RESTRICT tile_expert, const int* HAL_RESTRICT offsets,
                   const hal_i64* HAL_RESTRICT w13, int hidden, int inter, int group_size, int top_k,
                   int num_experts, int activation) {
    using namespace moe;
    __shared__ float s_red[MT][2 * COLS];
    const int tile = blockIdx.x;
    if (tile * MT >= offsets[num_experts]) return;  // a surplus tile of the worst-case grid
    const Expert ex = expert_of(w13, tile_expert[tile]);
    const hal_u32* qweight = static_cast<const hal_u32*>(ex.qweight);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.y * WARP + lane) * 4, N = 2 * inter;
    int tok[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const int pair = sorted_pairs[tile * MT + m];
        tok[m] = pair < 0 ? -1 : pair / top_k;
    }
    float acc[MT][8];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[m][c] = 0.f;
    if (n < inter) {
        const int rows_per_group = group_size / 8;
        for (int g = warp; g < hidden / group_size; g += KW) {
            float s[2][4], zs[2][4];
            int z[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                load_group(ex.scales, ex.zeros, 8, (hal_i64)g * N + h * inter + n, s[h], z);
#pragma unroll
                for (int c = 0; c < 4; ++c) zs[h][c] = -(float)z[c] * s[h][c];
            }
            for (int r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
                float w[2][8][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const hal_vec16 qv = hal_load16(qweight + (hal_i64)r * N + h * inter + n);
                    const hal_u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
                    dequant8(qw, s[h], zs[h], w[h]);
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (tok[m] < 0) break;  // a tile's rows come first, its padding after
                    const hal_t* xp = x + (hal_i64)tok[m] * hidden + r * 8;
                    float xf[8];
                    for (int j = 0; j < 8; ++j) xf[j] = hal_to_float(xp[j]);
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int c = 0; c < 8; ++c) acc[m][c] += xf[j] * w[c / 4][j][c % 4];
                }
            }
        }
    }
    reduce<8>(acc, s_red);
    for (int i = threadIdx.x; i < MT * COLS; i += NT) {
        const int m = i / COLS, cc = i % COLS, col = blockIdx.y * COLS + cc;
        if (col >= inter) continue;
        const float v = tok[m] < 0 ? 0.f : moe::act(s_red[m][cc], activation) * s_red[m][COLS + cc];
        act[(hal_i64)(tile * MT + m) * inter + col] = v;
    }
}

// 4b. W4A16 down.  Grid (max_tiles, ceil(hidden / (4 * warp))).  act float32 rows by row slot; y [num_pairs,
// hidden] float32 by pair.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w4_down(float* HAL_RESTRICT y, const float* HAL_RESTRICT act, const int* HAL_RESTRICT sorted_pairs,
                const int* HAL_RESTRICT tile_expert, const int* HAL_RESTRICT offsets, const hal_i64* HAL_RESTRICT w2,
                int hidden, int inter, int group_size, int num_experts) {
    using namespace moe;
    __shared__ float s_red[MT][COLS];
    const int tile = blockIdx.x;
    if (tile * MT >= offsets[num_experts]) return;
    const Expert ex = expert_of(w2, tile_expert[tile]);
    const hal_u32* qweight = static_cast<const hal_u32*>(ex.qweight);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.y * WARP + lane) * 4;
    int pairs[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) pairs[m] = sorted_pairs[tile * MT + m];
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;
    if (n < hidden) {
        const int rows_per_group = group_size / 8;
        for (int g = warp; g < inter / group_size; g += KW) {
            float s[4], zs[4];
            int z[4];
            load_group(ex.scales, ex.zeros, 8, (hal_i64)g * hidden + n, s, z);
#pragma unroll
            for (int c = 0; c < 4; ++c) zs[c] = -(float)z[c] * s[c];
            for (int r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
                const hal_vec16 qv = hal_load16(qweight + (hal_i64)r * hidden + n);
                const hal_u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
                float w[8][4];
                dequant8(qw, s, zs, w);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (pairs[m] < 0) break;
                    const float* ap = act + (hal_i64)(tile * MT + m) * inter + r * 8;
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[m][c] += ap[j] * w[j][c];
                }
            }
        }
    }
    reduce<4>(acc, s_red);
    for (int i = threadIdx.x; i < MT * COLS; i += NT) {
        const int m = i / COLS, cc = i % COLS, col = blockIdx.y * COLS + cc;
        if (col < hidden && pairs[m] >= 0) y[(hal_i64)pairs[m] * hidden + col] = s_red[m][cc];
    }
}
#else
namespace moe {
#if HAL_QBITS == 8
typedef hal_u8 Code;       // row-major uint8 codes [K, N]
constexpr int ZERO = 128;  // the default zero point

// acc[m][c] += s[c] * (xq[m] . (q[:, c] - z[c])) over one group of rows k0 .. k0 + group_size (4 columns at n of a
// row-major uint8 weight with row stride N); rows[m] < 0 ends the tile.
HAL_DEVICE void i8_group(float (*acc)[4], const Code* qweight, const hal_i8* xq, const hal_i64* rows, int K, int N,
                         int n, int k0, int group_size, const float* s, const int* z) {
    int iacc[MT][4], xsum[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        xsum[m] = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) iacc[m][c] = 0;
    }
    for (int k = k0; k < k0 + group_size; k += 4) {
        hal_u32 r[4], col[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) r[a] = *reinterpret_cast<const hal_u32*>(qweight + (hal_i64)(k + a) * N + n);
#pragma unroll
        for (int c = 0; c < 4; ++c)
            col[c] = ((r[0] >> (8 * c)) & 0xffu) | (((r[1] >> (8 * c)) & 0xffu) << 8) |
                     (((r[2] >> (8 * c)) & 0xffu) << 16) | (((r[3] >> (8 * c)) & 0xffu) << 24);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (rows[m] < 0) break;
            const int xa = *reinterpret_cast<const int*>(xq + rows[m] * K + k);
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
#else
typedef hal_u32 Code;    // int4 codes, 8 consecutive rows of K a word: [K / 8, N]
constexpr int ZERO = 8;  // the default zero point

// As the int8 one for int4 codes (W4A8): each word's 8 codes of a column split into the nibbles of rows
// k, k+2, k+4, k+6 and of rows k+1, k+3, k+5, k+7, one byte each, against the activations of the same rows; the
// integer sums are exact, so the order does not change them.
HAL_DEVICE void i8_group(float (*acc)[4], const Code* qweight, const hal_i8* xq, const hal_i64* rows, int K, int N,
                         int n, int k0, int group_size, const float* s, const int* z) {
    int iacc[MT][4], xsum[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        xsum[m] = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) iacc[m][c] = 0;
    }
    for (int k = k0; k < k0 + group_size; k += 8) {
        const hal_vec16 qv = hal_load16(qweight + (hal_i64)(k / 8) * N + n);
        const hal_u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
        hal_u32 even[4], odd[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            even[c] = qw[c] & 0x0f0f0f0fu;
            odd[c] = (qw[c] >> 4) & 0x0f0f0f0fu;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (rows[m] < 0) break;
            const hal_i8* xr = xq + rows[m] * K + k;
            const hal_u32 a0 = *reinterpret_cast<const hal_u32*>(xr), a1 = *reinterpret_cast<const hal_u32*>(xr + 4);
            const int xe = (int)((a0 & 0xffu) | ((a0 >> 8) & 0xff00u) | ((a1 << 16) & 0xff0000u) |
                                 ((a1 << 8) & 0xff000000u));
            const int xo = (int)(((a0 >> 8) & 0xffu) | ((a0 >> 16) & 0xff00u) | ((a1 << 8) & 0xff0000u) |
                                 (a1 & 0xff000000u));
            xsum[m] = hal_dot4_s8u8(xo, 0x01010101u, hal_dot4_s8u8(xe, 0x01010101u, xsum[m]));
#pragma unroll
            for (int c = 0; c < 4; ++c)
                iacc[m][c] = hal_dot4_s8u8(xo, odd[c], hal_dot4_s8u8(xe, even[c], iacc[m][c]));
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] += s[c] * (float)(iacc[m][c] - z[c] * xsum[m]);
}
#endif

// 4a with int8 activations: xq int8 [num_tokens, hidden] and sx float [num_tokens] from hal_w8a8_quantize_rows.
// Grid and outputs as hal_moe_w4_gate_up.
HAL_DEVICE void i8_gate_up(float (*s_red)[2 * COLS], float* HAL_RESTRICT act, const hal_i8* HAL_RESTRICT xq,
                           const float* HAL_RESTRICT sx, const int* HAL_RESTRICT sorted_pairs,
                           const int* HAL_RESTRICT tile_expert, const int* HAL_RESTRICT offsets,
                           const hal_i64* HAL_RESTRICT w13, int hidden, int inter, int group_size, int top_k,
                           int num_experts, int activation) {
    const int tile = blockIdx.x;
    if (tile * MT >= offsets[num_experts]) return;
    const Expert ex = expert_of(w13, tile_expert[tile]);
    const Code* qweight = static_cast<const Code*>(ex.qweight);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.y * WARP + lane) * 4, N = 2 * inter;
    hal_i64 tok[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const int pair = sorted_pairs[tile * MT + m];
        tok[m] = pair < 0 ? -1 : pair / top_k;
    }
    float acc[2][MT][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[h][m][c] = 0.f;
    if (n < inter) {
        for (int g = warp; g < hidden / group_size; g += KW) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float s[4];
                int z[4];
                load_group(ex.scales, ex.zeros, ZERO, (hal_i64)g * N + h * inter + n, s, z);
                i8_group(acc[h], qweight, xq, tok, hidden, N, h * inter + n, g * group_size, group_size, s, z);
            }
        }
    }
    float both[MT][8];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 8; ++c) both[m][c] = acc[c / 4][m][c % 4];
    reduce<8>(both, s_red);
    for (int i = threadIdx.x; i < MT * COLS; i += NT) {
        const int m = i / COLS, cc = i % COLS, col = blockIdx.y * COLS + cc;
        if (col >= inter) continue;
        float v = 0.f;
        if (tok[m] >= 0) {
            const float g = hal_mul_scale_ftz_safe(s_red[m][cc], sx[tok[m]]);
            const float u = hal_mul_scale_ftz_safe(s_red[m][COLS + cc], sx[tok[m]]);
            v = moe::act(g, activation) * u;
        }
        act[(hal_i64)(tile * MT + m) * inter + col] = v;
    }
}

// 4b with int8 activations: aq int8 and sa float, the gated intermediate's rows quantised by hal_w8a8_quantize_rows
// (float32).
HAL_DEVICE void i8_down(float (*s_red)[COLS], float* HAL_RESTRICT y, const hal_i8* HAL_RESTRICT aq,
                        const float* HAL_RESTRICT sa, const int* HAL_RESTRICT sorted_pairs,
                        const int* HAL_RESTRICT tile_expert, const int* HAL_RESTRICT offsets,
                        const hal_i64* HAL_RESTRICT w2, int hidden, int inter, int group_size, int num_experts) {
    const int tile = blockIdx.x;
    if (tile * MT >= offsets[num_experts]) return;
    const Expert ex = expert_of(w2, tile_expert[tile]);
    const Code* qweight = static_cast<const Code*>(ex.qweight);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n = (blockIdx.y * WARP + lane) * 4;
    int pairs[MT];
    hal_i64 rows[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        pairs[m] = sorted_pairs[tile * MT + m];
        rows[m] = pairs[m] < 0 ? -1 : (hal_i64)tile * MT + m;
    }
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;
    if (n < hidden) {
        for (int g = warp; g < inter / group_size; g += KW) {
            float s[4];
            int z[4];
            load_group(ex.scales, ex.zeros, ZERO, (hal_i64)g * hidden + n, s, z);
            i8_group(acc, qweight, aq, rows, inter, hidden, n, g * group_size, group_size, s, z);
        }
    }
    reduce<4>(acc, s_red);
    for (int i = threadIdx.x; i < MT * COLS; i += NT) {
        const int m = i / COLS, cc = i % COLS, col = blockIdx.y * COLS + cc;
        if (col < hidden && pairs[m] >= 0)
            y[(hal_i64)pairs[m] * hidden + col] = hal_mul_scale_ftz_safe(s_red[m][cc], sa[rows[m]]);
    }
}
}  // namespace moe

// 4a. W8A8 or W4A8 gate/up (moe::i8_gate_up): the entry point's name says which the build holds.
#if HAL_QBITS == 8
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w8_gate_up(float* HAL_RESTRICT act, const hal_i8* HAL_RESTRICT xq, const float* HAL_RESTRICT sx,
                   const int* HAL_RESTRICT sorted_pairs, const int* HAL_RESTRICT tile_expert,
                   const int* HAL_RESTRICT offsets, const hal_i64* HAL_RESTRICT w13, int hidden, int inter,
                   int group_size, int top_k, int num_experts, int activation)
#else
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w4a8_gate_up(float* HAL_RESTRICT act, const hal_i8* HAL_RESTRICT xq, const float* HAL_RESTRICT sx,
                     const int* HAL_RESTRICT sorted_pairs, const int* HAL_RESTRICT tile_expert,
                     const int* HAL_RESTRICT offsets, const hal_i64* HAL_RESTRICT w13, int hidden, int inter,
                     int group_size, int top_k, int num_experts, int activation)
#endif
{
    __shared__ float s_red[moe::MT][2 * moe::COLS];
    moe::i8_gate_up(s_red, act, xq, sx, sorted_pairs, tile_expert, offsets, w13, hidden, inter, group_size, top_k,
                    num_experts, activation);
}

// 4b. W8A8 or W4A8 down (moe::i8_down).
#if HAL_QBITS == 8
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w8_down(float* HAL_RESTRICT y, const hal_i8* HAL_RESTRICT aq, const float* HAL_RESTRICT sa,
                const int* HAL_RESTRICT sorted_pairs, const int* HAL_RESTRICT tile_expert,
                const int* HAL_RESTRICT offsets, const hal_i64* HAL_RESTRICT w2, int hidden, int inter,
                int group_size, int num_experts)
#else
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(moe::NT)
hal_moe_w4a8_down(float* HAL_RESTRICT y, const hal_i8* HAL_RESTRICT aq, const float* HAL_RESTRICT sa,
                  const int* HAL_RESTRICT sorted_pairs, const int* HAL_RESTRICT tile_expert,
                  const int* HAL_RESTRICT offsets, const hal_i64* HAL_RESTRICT w2, int hidden, int inter,
                  int group_size, int num_experts)
#endif
{
    __shared__ float s_red[moe::MT][moe::COLS];
    moe::i8_down(s_red, y, aq, sa, sorted_pairs, tile_expert, offsets, w2, hidden, inter, group_size, num_experts);
}
#endif

// 5. Grid (num_tokens, ceil(hidden / HAL_MOE_ALIGN_THREADS)), one column per thread.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_MOE_ALIGN_THREADS)
hal_moe_combine(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT y, const float* HAL_RESTRICT topk_weights,
                int hidden, int top_k) {
    const int col = blockIdx.y * HAL_MOE_ALIGN_THREADS + threadIdx.x;
    if (col >= hidden) return;
    const hal_i64 t = blockIdx.x;
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) acc += topk_weights[t * top_k + j] * y[(t * top_k + j) * hidden + col];
    out[t * hidden + col] = hal_from_float(acc);
}
