/* The plain C ABI of hal-cpu's compiled kernels (loaded with ctypes by hal_cpu._native).
 *
 * Every kernel validates nothing: the Python wrappers pass validated shapes,
 * strides in elements (the last dimension always contiguous) and dtype codes.
 * Return value: 0 on success, HAL_ENOMEM when a bounded workspace could not
 * be allocated (nothing has been written to the outputs then).
 */
#ifndef HAL_CPU_KERNELS_H
#define HAL_CPU_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

enum { HAL_F32 = 0, HAL_F16 = 1, HAL_BF16 = 2 };
enum { HAL_OK = 0, HAL_ENOMEM = 1 };

/* The variant chosen at load time ("avx512vnni", "avx512", "avx2", "baseline"); forced = NULL or "" picks the best. */
const char *hal_cpu_select_isa(const char *forced);
const char *hal_cpu_isa(void);
const char *hal_cpu_available_isas(void);
int hal_cpu_default_threads(void);
/* Sets the microseconds a pool worker polls for the next job before it blocks (0: block at once);
   returns the previous setting. */
int64_t hal_cpu_set_spin_us(int64_t us);
/* The pool's counters since it was made: jobs in which a worker lost its core to another process (starved), and
   jobs run on the calling thread alone in the back-off that follows (serial). */
void hal_cpu_pool_stats(int64_t *starved_jobs, int64_t *serial_jobs);

/* Variable-length paged attention (hal-core's paged_attention contract): the new tokens of a batch that mixes
 * prompts, prompt chunks and decoding sequences, against a paged K/V cache. Strides are in elements; the last
 * dimension of query, caches and out is contiguous. */
typedef struct hal_cpu_attention_args {
    const void *query;                       /* [num_tokens, num_heads, head_size] */
    int64_t q_token_stride, q_head_stride;
    const void *key_cache, *value_cache;     /* [num_blocks, num_kv_heads, block_size, head_size]; K and V may differ */
    int64_t k_block_stride, k_head_stride, k_token_stride;
    int64_t v_block_stride, v_head_stride, v_token_stride;
    const int32_t *block_tables;             /* [num_seqs, bt_stride] */
    int64_t bt_stride;
    const int32_t *seq_lens;                 /* [num_seqs], new tokens included */
    const int32_t *query_start_loc;          /* [num_seqs + 1]; NULL: one new token per sequence (decode) */
    const float *sinks;                      /* [num_heads] or NULL */
    const float *alibi_slopes;               /* [num_heads] or NULL */
    void *out;                               /* [num_tokens, num_heads, head_size], head stride = head_size */
    int64_t out_token_stride;
    int32_t out_dtype;                       /* HAL_F32 / HAL_F16 / HAL_BF16: the kernel writes the final dtype */
    int32_t num_seqs, num_tokens, num_heads, num_kv_heads, block_size, head_size;
    int32_t dtype;                           /* of query and caches */
    int32_t max_query_len;                   /* >= every q_len (bounds the query tiles) */
    int32_t window;                          /* 0: none; else a token sees keys t with p - window < t <= p */
    float scale, softcap;                    /* softcap 0: none */
    int32_t partition_tokens;                /* split-KV partition of decode rows; 0: no split */
    int32_t query_tile;                      /* tokens per prefill task (times the GQA group: its rows); 0: the kernel's */
    int32_t threads;
} hal_cpu_attention_args;

/* "size=N;field=offset:size;..." for a struct of this ABI ("attention"), NULL for an unknown name: hal_cpu._abi
 * compares it with its ctypes mirror when the library loads. */
const char *hal_cpu_abi(const char *name);

/* Returns HAL_OK, or HAL_ENOMEM (nothing written to out). */
int hal_cpu_paged_attention(const hal_cpu_attention_args *args);

/* Whether bf16/fp16 prefill attention runs on AMX tiles here (1: the CPU has AMX-BF16, the OS granted the tile
 * state, and it is not turned off) or on vector FMAs (0). */
int hal_cpu_attention_amx(void);
/* Allows (1, the default) or forbids (0) AMX for attention in this process; returns the previous setting. */
int hal_cpu_set_attention_amx(int enabled);

int hal_cpu_write_kv_cache(
    const void *key, int64_t k_token_stride, int64_t k_head_stride,
    const void *value, int64_t v_token_stride, int64_t v_head_stride,
    void *key_cache, void *value_cache,
    int64_t c_block_stride, int64_t c_head_stride, int64_t c_token_stride,
    const void *slots, int32_t slot_bytes, int64_t num_tokens, int32_t num_kv_heads, int32_t block_size,
    int32_t head_size, int32_t elem_bytes, int32_t threads);

/* x [M, K] (row stride x_stride) to float32 [M, K] (contiguous). */
int hal_cpu_to_float32(const void *x, int32_t dtype, int64_t x_stride, int64_t m, int64_t k, float *out,
                       int32_t threads);

/* W4A16 without act-order, group_size % 8 == 0: y [M, N] fp32 = x @ dequant(w), int4 unpacked in registers.
 * n_tile: columns per task. k_parts (small M only, else ignored): K is cut into that many runs of whole groups,
 * each summed on its own and the runs added in order at the end; the result depends on k_parts, not on
 * n_tile or threads. */
int hal_cpu_w4a16_gemv(
    const void *x, int32_t x_dtype, int64_t x_stride, int64_t m, int64_t k, int64_t n,
    const uint32_t *qweight, const void *scales, int32_t s_dtype, const uint8_t *zeros, int32_t default_zero,
    int64_t group_size, float *y, int64_t n_tile, int32_t k_parts, int32_t threads);

/* Columns [n0, n1) of the dequantised weight (int4 or int8) as float32 [K, n1 - n0] (row stride ld). */
int hal_cpu_dequant_tile(
    const void *qweight, int32_t bits, const void *scales, int32_t s_dtype, const uint8_t *zeros,
    int32_t default_zero, const int32_t *g_idx, int64_t group_size, int64_t k, int64_t n, int64_t n0, int64_t n1,
    float *out, int64_t ld, int32_t threads);

/* W8A8: per-token int8 quantisation fused, exact integer sums per group, y [M, N] fp32.
 * perm (nullable) orders rows so groups are contiguous runs (act-order); group_starts [groups + 1]
 * bounds those runs in the permuted order. A row of x holding NaN or Inf gives a row of NaN.
 * k_parts (M <= 2 only, else ignored): the segments are cut into that many runs, each summed on its own
 * and the runs added in order; every variant gives the same bits for the same k_parts. */
int hal_cpu_w8a8_gemm(
    const void *x, int32_t x_dtype, int64_t x_stride, int64_t m, int64_t k, int64_t n,
    const uint8_t *qweight, const void *scales, int32_t s_dtype, const uint8_t *zeros, int32_t default_zero,
    const int32_t *perm, const int64_t *group_starts, const int32_t *group_of_run, int64_t runs,
    float *y, int64_t n_tile, int32_t k_parts, int32_t threads);

/* W4A16 for large M (act-order included): a cache-blocked float32 GEMM on B panels dequantised from int4
 * into a per-task buffer (256 KiB); the activations are packed once (M rounded up to the tile, times K floats).
 * g_idx (nullable) gives each row of K its group. */
int hal_cpu_w4a16_blocked(
    const void *x, int32_t x_dtype, int64_t x_stride, int64_t m, int64_t k, int64_t n,
    const uint32_t *qweight, const void *scales, int32_t s_dtype, const uint8_t *zeros, int32_t default_zero,
    const int32_t *g_idx, int64_t group_size, float *y, int32_t threads);

/* 1 when hal_cpu_w4a16_gemv runs fp16/bf16 activations through AVX512_BF16 dot products on this CPU, else 0. */
int hal_cpu_w4a16_half_dot(void);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif
