// Rotary position embedding, in place on the query and key heads.
//
// One CTA per token; its threads walk the (head, pair) items of the token's query heads, then its key heads.
// A pair is (x[i], x[i + rotary_dim / 2]) (NeoX) or (x[2i], x[2i + 1]) (GPT-J, gptj != 0), rotated by the
// token's row of cos_sin_cache (cosines, then sines, float32) in float32 and rounded once to HAL_DTYPE.
// Strides are in elements; the head rows are contiguous.  Defines: HAL_DTYPE (0 f32, 1 f16, 2 bf16),
// HAL_POS_INT64 (1: positions are int64, 0: int32; default 1), optional HAL_NUM_THREADS (default 128).
// See README.md.
//
// Index check (hal_index_checks.cuh): a position outside [0, max_position) is never read from the table; the
// token is left as it is and positions is reported in error_flag.
#include "hal_common.cuh"
#include "hal_index_checks.cuh"

// The flag bit of positions (beside hal_index_checks.cuh's; hal_cupy._index_errors.ERROR_ARGUMENTS names it).
#define HAL_ERR_POSITIONS 128

#ifndef HAL_POS_INT64
#define HAL_POS_INT64 1
#endif
#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 128
#endif

#if HAL_POS_INT64
typedef hal_i64 hal_pos_t;
#else
typedef int hal_pos_t;
#endif

HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_rotary_embedding(const hal_pos_t* HAL_RESTRICT positions, hal_t* query, hal_t* key,
                     const float* HAL_RESTRICT cos_sin_cache, hal_i64 q_token_stride, hal_i64 q_head_stride,
                     hal_i64 k_token_stride, hal_i64 k_head_stride, int num_heads, int num_kv_heads,
                     int rotary_dim, int gptj, hal_i64 max_position, int* HAL_RESTRICT error_flag) {
    const hal_i64 token = blockIdx.x;
    const hal_i64 pos = positions[token];
    if (pos < 0 || pos >= max_position) {
        if (threadIdx.x == 0) hal_report_index_error(error_flag, HAL_ERR_POSITIONS);
        return;
    }
    const int half = rotary_dim / 2;
    const float* cos = cos_sin_cache + pos * rotary_dim;
    const float* sin = cos + half;
    const int heads = num_heads + (key != 0 ? num_kv_heads : 0);
    const int items = heads * half;
    for (int item = threadIdx.x; item < items; item += HAL_NUM_THREADS) {
        const int h = item / half;
        const int i = item - h * half;
        hal_t* x = h < num_heads ? query + token * q_token_stride + (hal_i64)h * q_head_stride
                                 : key + token * k_token_stride + (hal_i64)(h - num_heads) * k_head_stride;
        const int a = gptj ? 2 * i : i;
        const int b = gptj ? 2 * i + 1 : i + half;
        const float x1 = hal_to_float(x[a]);
        const float x2 = hal_to_float(x[b]);
        const float c = cos[i];
        const float s = sin[i];
        x[a] = hal_from_float(x1 * c - x2 * s);
        x[b] = hal_from_float(x2 * c + x1 * s);
    }
}
