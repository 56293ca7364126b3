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
/* The counters of parallel jobs since the library loaded, in this order: jobs in which a helper thread lost its
   core to another process (starved); jobs run on the calling thread alone in the back-off that follows (serial);
   jobs run on hal's own pool (own) and on the host's OpenMP runtime (host); jobs run on the calling thread alone
   because it was inside an OpenMP parallel region (nested). Writes the first min(n, HAL_CPU_POOL_COUNTERS). */
enum { HAL_CPU_POOL_COUNTERS = 5 };
void hal_cpu_pool_stats(int64_t *counts, int32_t n);
/* The path of the OpenMP runtime the parallel jobs run on (one the process had loaded), or NULL: hal's own pool. */
const char *hal_cpu_host_runtime(void);
/* Allows (1, the default) or forbids (0) running parallel jobs on a loaded OpenMP runtime; returns the previous
   setting. */
int hal_cpu_set_host_pool(int enabled);
/* Testing: applies the back-off of a starved job (counted as one), as if a helper of the last job had lost its core:
   of a host-pool job (host = 1: the next jobs run on the own pool) or an own-pool job (0: on the caller alone). */
void hal_cpu_pool_note_starved(int host);

/* Every kernel takes one pointer to its argument struct. Each struct's fields are listed once, in an X-macro
 * (HAL_CPU_<KERNEL>_FIELDS(F): F(type, name) per field), which declares the struct below and lets
 * hal_cpu_abi(name) describe its layout; hal_cpu._abi mirrors each struct with ctypes and compares the two
 * when the library loads. Adding an argument: one F(...) line here, one field in _abi.py, and the kernel that
 * reads it. */
#define HAL_CPU_DECLARE_FIELD(type, name) type name;

/* Variable-length paged attention (hal-core's paged_attention contract): the new tokens of a batch that mixes
 * prompts, prompt chunks and decoding sequences, against a paged K/V cache. Strides are in elements; the last
 * dimension of query, caches and out is contiguous. */
#define HAL_CPU_ATTENTION_FIELDS(F)                                                                            \
    F(const void *, query)              /* [num_tokens, num_heads, head_size] */                               \
    F(int64_t, q_token_stride)                                                                                 \
    F(int64_t, q_head_stride)                                                                                  \
    F(const void *, key_cache)          /* [num_blocks, num_kv_heads, block_size, head_size]; K and V may */    \
    F(const void *, value_cache)        /* differ in strides */                                                \
    F(int64_t, k_block_stride)                                                                                 \
    F(int64_t, k_head_stride)                                                                                  \
    F(int64_t, k_token_stride)                                                                                 \
    F(int64_t, v_block_stride)                                                                                 \
    F(int64_t, v_head_stride)                                                                                  \
    F(int64_t, v_token_stride)                                                                                 \
    F(const int32_t *, block_tables)    /* [num_seqs, bt_stride] */                                            \
    F(int64_t, bt_stride)                                                                                      \
    F(const int32_t *, seq_lens)        /* [num_seqs], new tokens included */                                  \
    F(const int32_t *, query_start_loc) /* [num_seqs + 1]; NULL: one new token per sequence (decode) */        \
    F(const float *, sinks)             /* [num_heads] or NULL */                                              \
    F(const float *, alibi_slopes)      /* [num_heads] or NULL */                                              \
    F(void *, out)                      /* [num_tokens, num_heads, head_size], head stride = head_size */      \
    F(int64_t, out_token_stride)                                                                               \
    F(int32_t, out_dtype)               /* HAL_F32 / HAL_F16 / HAL_BF16: the kernel writes the final dtype */  \
    F(int32_t, num_seqs)                                                                                       \
    F(int32_t, num_tokens)                                                                                     \
    F(int32_t, num_heads)                                                                                      \
    F(int32_t, num_kv_heads)                                                                                   \
    F(int32_t, block_size)                                                                                     \
    F(int32_t, head_size)                                                                                      \
    F(int32_t, dtype)                   /* of query and caches */                                              \
    F(int32_t, max_query_len)           /* >= every q_len (bounds the query tiles) */                          \
    F(int32_t, window)                  /* 0: none; else a token sees keys t with p - window < t <= p */       \
    F(float, scale)                                                                                            \
    F(float, softcap)                   /* 0: none */                                                          \
    F(int32_t, partition_tokens)        /* split-KV partition of decode rows; 0: no split */                   \
    F(int32_t, query_tile)              /* tokens per prefill task (times the GQA group: its rows); 0: the   */ \
                                        /* kernel's */                                                         \
    F(int32_t, threads)
typedef struct hal_cpu_attention_args { HAL_CPU_ATTENTION_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_attention_args;

/* Scatter new keys and values into the paged caches through a slot mapping. Strides in elements; the cache
 * strides are shared by key_cache and value_cache, the head rows (head_size elements) are contiguous. */
#define HAL_CPU_WRITE_KV_CACHE_FIELDS(F)                                                                       \
    F(const void *, key)                /* [num_tokens, num_kv_heads, head_size] */                            \
    F(int64_t, k_token_stride)                                                                                 \
    F(int64_t, k_head_stride)                                                                                  \
    F(const void *, value)              /* [num_tokens, num_kv_heads, head_size] */                            \
    F(int64_t, v_token_stride)                                                                                 \
    F(int64_t, v_head_stride)                                                                                  \
    F(void *, key_cache)                /* [num_blocks, num_kv_heads, block_size, head_size] */                \
    F(void *, value_cache)              /* the same layout */                                                  \
    F(int64_t, c_block_stride)                                                                                 \
    F(int64_t, c_head_stride)                                                                                  \
    F(int64_t, c_token_stride)                                                                                 \
    F(const void *, slots)              /* [num_tokens] int32 or int64; a negative slot is skipped */          \
    F(int64_t, num_tokens)                                                                                     \
    F(int32_t, slot_bytes)              /* 4 or 8 */                                                           \
    F(int32_t, num_kv_heads)                                                                                   \
    F(int32_t, block_size)                                                                                     \
    F(int32_t, head_size)                                                                                      \
    F(int32_t, elem_bytes)              /* bytes of one cache element */                                       \
    F(int32_t, threads)
typedef struct hal_cpu_write_kv_cache_args {
    HAL_CPU_WRITE_KV_CACHE_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_write_kv_cache_args;

/* x [M, K] (row stride x_stride elements) to float32 out [M, K] (contiguous). */
#define HAL_CPU_TO_FLOAT32_FIELDS(F)                                                                           \
    F(const void *, x)                                                                                         \
    F(int64_t, x_stride)                                                                                       \
    F(int64_t, m)                                                                                              \
    F(int64_t, k)                                                                                              \
    F(float *, out)                                                                                            \
    F(int32_t, dtype)                   /* of x: HAL_F32 / HAL_F16 / HAL_BF16 */                               \
    F(int32_t, threads)
typedef struct hal_cpu_to_float32_args { HAL_CPU_TO_FLOAT32_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_to_float32_args;
/* out [n] = x [n] rounded to nearest even in fp16 or bf16 (numpy's and ml_dtypes' casts; a bf16 NaN becomes the
 * quiet NaN of its sign), contiguous, in parallel tasks of `chunk` elements. */
#define HAL_CPU_FROM_FLOAT32_FIELDS(F)                                                                         \
    F(const float *, x)                                                                                        \
    F(void *, out)                                                                                             \
    F(int64_t, n)                                                                                              \
    F(int64_t, chunk)                                                                                          \
    F(int32_t, dtype)                   /* of out: HAL_F16 / HAL_BF16 */                                       \
    F(int32_t, threads)
typedef struct hal_cpu_from_float32_args {
    HAL_CPU_FROM_FLOAT32_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_from_float32_args;

/* W4A16 without act-order, group_size % 8 == 0: y [M, N] fp32 = x @ dequant(w), int4 unpacked in registers.
 * The packed weight is qweight [K / 8, N] (8 codes per word, row 8r + j in nibble j), scales and zeros
 * [K / group_size, N]. k_parts (small M only, else ignored): K is cut into that many runs of whole groups,
 * each summed on its own and the runs added in order at the end; the result depends on k_parts, not on
 * n_tile or threads. */
#define HAL_CPU_W4A16_GEMV_FIELDS(F)                                                                           \
    F(const void *, x)                  /* [M, K], row stride x_stride elements */                             \
    F(int64_t, x_stride)                                                                                       \
    F(int64_t, m)                                                                                              \
    F(int64_t, k)                                                                                              \
    F(int64_t, n)                                                                                              \
    F(const uint32_t *, qweight)        /* [K / 8, N] */                                                       \
    F(const void *, scales)             /* [K / group_size, N] in s_dtype */                                   \
    F(const uint8_t *, zeros)           /* [K / group_size, N], or NULL: default_zero everywhere */            \
    F(int64_t, group_size)                                                                                     \
    F(float *, y)                       /* [M, N] float32, contiguous */                                       \
    F(int64_t, n_tile)                  /* columns per task */                                                 \
    F(int32_t, x_dtype)                 /* HAL_F32 / HAL_F16 / HAL_BF16 */                                     \
    F(int32_t, s_dtype)                 /* of scales */                                                        \
    F(int32_t, default_zero)                                                                                   \
    F(int32_t, k_parts)                                                                                        \
    F(int32_t, threads)
typedef struct hal_cpu_w4a16_gemv_args { HAL_CPU_W4A16_GEMV_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_w4a16_gemv_args;

/* Columns [n0, n1) of the dequantised weight (int4 or int8) as float32 out [K, n1 - n0] (row stride ld). */
#define HAL_CPU_DEQUANT_TILE_FIELDS(F)                                                                         \
    F(const void *, qweight)            /* int4: uint32 [K / 8, N]; int8: uint8 [K, N] */                      \
    F(const void *, scales)             /* [groups, N] in s_dtype */                                           \
    F(const uint8_t *, zeros)           /* [groups, N], or NULL: default_zero everywhere */                    \
    F(const int32_t *, g_idx)           /* [K] group of each row (act-order), or NULL: row / group_size */     \
    F(int64_t, group_size)                                                                                     \
    F(int64_t, k)                                                                                              \
    F(int64_t, n)                                                                                              \
    F(int64_t, n0)                                                                                             \
    F(int64_t, n1)                                                                                             \
    F(float *, out)                                                                                            \
    F(int64_t, ld)                                                                                             \
    F(int32_t, bits)                    /* 4 or 8 */                                                           \
    F(int32_t, s_dtype)                                                                                        \
    F(int32_t, default_zero)                                                                                   \
    F(int32_t, threads)
typedef struct hal_cpu_dequant_tile_args {
    HAL_CPU_DEQUANT_TILE_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_dequant_tile_args;

/* W8A8: per-token int8 quantisation fused, exact integer sums per group, y [M, N] fp32.
 * perm (nullable) orders rows so groups are contiguous runs (act-order); group_starts [runs + 1]
 * bounds those runs in the permuted order, group_of_run [runs] names each run's group. A row of x
 * holding NaN or Inf gives a row of NaN. k_parts (small M only, else ignored): the segments are cut
 * into that many runs, each summed on its own and the runs added in order; every variant gives the
 * same bits for the same k_parts. */
#define HAL_CPU_W8A8_GEMM_FIELDS(F)                                                                            \
    F(const void *, x)                  /* [M, K], row stride x_stride elements */                             \
    F(int64_t, x_stride)                                                                                       \
    F(int64_t, m)                                                                                              \
    F(int64_t, k)                                                                                              \
    F(int64_t, n)                                                                                              \
    F(const uint8_t *, qweight)         /* [K, N] codes */                                                     \
    F(const void *, scales)             /* [groups, N] in s_dtype */                                           \
    F(const uint8_t *, zeros)           /* [groups, N], or NULL: default_zero everywhere */                    \
    F(const int32_t *, perm)            /* [K] or NULL */                                                      \
    F(const int64_t *, group_starts)    /* [runs + 1] */                                                       \
    F(const int32_t *, group_of_run)    /* [runs] */                                                           \
    F(int64_t, runs)                                                                                           \
    F(float *, y)                       /* [M, N] float32, contiguous */                                       \
    F(int64_t, n_tile)                  /* columns per small-M task */                                         \
    F(int32_t, x_dtype)                                                                                        \
    F(int32_t, s_dtype)                                                                                        \
    F(int32_t, default_zero)                                                                                   \
    F(int32_t, k_parts)                                                                                        \
    F(int32_t, threads)
typedef struct hal_cpu_w8a8_gemm_args { HAL_CPU_W8A8_GEMM_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_w8a8_gemm_args;

/* W4A16 for large M (act-order included): a cache-blocked float32 GEMM on B panels dequantised from int4
 * into a per-task buffer (256 KiB); the activations are packed once (M rounded up to the tile, times K floats). */
#define HAL_CPU_W4A16_BLOCKED_FIELDS(F)                                                                        \
    F(const void *, x)                  /* [M, K], row stride x_stride elements */                             \
    F(int64_t, x_stride)                                                                                       \
    F(int64_t, m)                                                                                              \
    F(int64_t, k)                                                                                              \
    F(int64_t, n)                                                                                              \
    F(const uint32_t *, qweight)        /* [K / 8, N] */                                                       \
    F(const void *, scales)             /* [groups, N] in s_dtype */                                           \
    F(const uint8_t *, zeros)           /* [groups, N], or NULL: default_zero everywhere */                    \
    F(const int32_t *, g_idx)           /* [K] group of each row (act-order), or NULL: row / group_size */     \
    F(int64_t, group_size)                                                                                     \
    F(float *, y)                       /* [M, N] float32, contiguous */                                       \
    F(int32_t, x_dtype)                                                                                        \
    F(int32_t, s_dtype)                                                                                        \
    F(int32_t, default_zero)                                                                                   \
    F(int32_t, threads)
typedef struct hal_cpu_w4a16_blocked_args {
    HAL_CPU_W4A16_BLOCKED_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_w4a16_blocked_args;

/* W4A8: int4 weights (no act-order, group_size a multiple of 8, at most 32768) times activations quantised per
 * token to int8 inside the kernel, bit for bit as hal_core.quant.quantize_activations; integer sums exact per
 * group, y [M, N] fp32 = sx * sum over groups of scale * (sum(q * code) - zero * sum(q)), every variant and thread
 * count giving the same bits. A row of x holding NaN or Inf gives a row of NaN. */
#define HAL_CPU_W4A8_GEMM_FIELDS(F)                                                                            \
    F(const void *, x)                  /* [M, K], row stride x_stride elements */                             \
    F(int64_t, x_stride)                                                                                       \
    F(int64_t, m)                                                                                              \
    F(int64_t, k)                                                                                              \
    F(int64_t, n)                                                                                              \
    F(const uint32_t *, qweight)        /* [K / 8, N] */                                                       \
    F(const void *, scales)             /* [K / group_size, N] in s_dtype */                                   \
    F(const uint8_t *, zeros)           /* [K / group_size, N], or NULL: default_zero everywhere */            \
    F(int64_t, group_size)                                                                                     \
    F(float *, y)                       /* [M, N] float32, contiguous */                                       \
    F(int32_t, x_dtype)                                                                                        \
    F(int32_t, s_dtype)                                                                                        \
    F(int32_t, default_zero)                                                                                   \
    F(int32_t, threads)
typedef struct hal_cpu_w4a8_gemm_args { HAL_CPU_W4A8_GEMM_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_w4a8_gemm_args;

/* sample: one token per row of logits (hal_core.ops.sample). Per-row parameters are [num_seqs]; the optional ones
 * NULL when off. out[s] is the token id, or -1 for a row holding NaN or only -inf. */
#define HAL_CPU_SAMPLE_FIELDS(F)                                                                               \
    F(const void *, logits)             /* [num_seqs, vocab_size], row stride logits_stride elements */        \
    F(int64_t, logits_stride)                                                                                  \
    F(const float *, temperature)       /* >= 0; 0: greedy */                                                  \
    F(const int32_t *, top_k)           /* or NULL; <= 0 or >= vocab_size: off */                              \
    F(const float *, top_p)             /* or NULL; 1: off */                                                  \
    F(const float *, min_p)             /* or NULL; 0: off */                                                  \
    F(const int64_t *, seeds)                                                                                  \
    F(int64_t *, out)                   /* [num_seqs] */                                                       \
    F(int64_t, num_seqs)                                                                                       \
    F(int64_t, vocab_size)                                                                                     \
    F(int32_t, dtype)                   /* of logits */                                                        \
    F(int32_t, threads)
typedef struct hal_cpu_sample_args { HAL_CPU_SAMPLE_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_sample_args;
/* RMSNorm of each row (hal-core's rms_norm): h = x, or x + residual (written back to residual in dtype, the norm then
 * taken of the stored sum); out = h * rsqrt(mean(h^2) + epsilon) * (weight_offset + weight). Strides are row strides
 * in elements (rows contiguous); float32 math, out rounded once. */
#define HAL_CPU_RMS_NORM_FIELDS(F)                                                                             \
    F(const void *, x)                  /* [num_tokens, hidden_size], row stride x_stride */                   \
    F(int64_t, x_stride)                                                                                       \
    F(const void *, weight)             /* [hidden_size] */                                                    \
    F(void *, residual)                 /* [num_tokens, hidden_size], row stride residual_stride, or NULL */   \
    F(int64_t, residual_stride)                                                                                \
    F(void *, out)                      /* [num_tokens, hidden_size], row stride out_stride */                 \
    F(int64_t, out_stride)                                                                                     \
    F(int64_t, num_tokens)                                                                                     \
    F(int64_t, hidden_size)                                                                                    \
    F(int64_t, rows_per_task)                                                                                  \
    F(float, epsilon)                                                                                          \
    F(float, weight_offset)                                                                                    \
    F(int32_t, dtype)                   /* of every array: HAL_F32 / HAL_F16 / HAL_BF16 */                     \
    F(int32_t, threads)
typedef struct hal_cpu_rms_norm_args { HAL_CPU_RMS_NORM_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_rms_norm_args;

/* out = act(gate) * up (hal-core's gated_activation), float32 math, out rounded once. */
enum { HAL_ACT_SILU = 0, HAL_ACT_GELU = 1, HAL_ACT_GELU_TANH = 2 };
#define HAL_CPU_GATED_ACTIVATION_FIELDS(F)                                                                     \
    F(const void *, gate)               /* [num_tokens, intermediate_size], row stride gate_stride */          \
    F(int64_t, gate_stride)                                                                                    \
    F(const void *, up)                 /* the same shape, row stride up_stride */                             \
    F(int64_t, up_stride)                                                                                      \
    F(void *, out)                      /* the same shape, row stride out_stride */                            \
    F(int64_t, out_stride)                                                                                     \
    F(int64_t, num_tokens)                                                                                     \
    F(int64_t, intermediate_size)                                                                              \
    F(int64_t, rows_per_task)                                                                                  \
    F(int32_t, activation)              /* HAL_ACT_SILU / HAL_ACT_GELU / HAL_ACT_GELU_TANH */                  \
    F(int32_t, dtype)                   /* of every array */                                                   \
    F(int32_t, threads)
typedef struct hal_cpu_gated_activation_args {
    HAL_CPU_GATED_ACTIVATION_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_gated_activation_args;
/* Rotary position embedding in place (hal-core's rotary_embedding contract): the first rotary_dim values of every
 * query and key head row rotated pair by pair by its token's row of cos_sin_cache, in float32. Strides in
 * elements; head rows are contiguous. A position outside [0, max_position) leaves its token as it is. */
#define HAL_CPU_ROTARY_EMBEDDING_FIELDS(F)                                                                     \
    F(const void *, positions)          /* [num_tokens] int32 or int64 */                                      \
    F(void *, query)                    /* [num_tokens, num_heads, head_size] */                               \
    F(int64_t, q_token_stride)                                                                                 \
    F(int64_t, q_head_stride)                                                                                  \
    F(void *, key)                      /* [num_tokens, num_kv_heads, head_size], or NULL: the query alone */  \
    F(int64_t, k_token_stride)                                                                                 \
    F(int64_t, k_head_stride)                                                                                  \
    F(const float *, cos_sin_cache)     /* [max_position, rotary_dim]: cosines, then sines */                  \
    F(int64_t, num_tokens)                                                                                     \
    F(int64_t, max_position)                                                                                   \
    F(int32_t, position_bytes)          /* 4 or 8 */                                                           \
    F(int32_t, num_heads)                                                                                      \
    F(int32_t, num_kv_heads)                                                                                   \
    F(int32_t, rotary_dim)              /* even, <= head_size */                                               \
    F(int32_t, dtype)                   /* of query and key: HAL_F32 / HAL_F16 / HAL_BF16 */                   \
    F(int32_t, gptj)                    /* 1: pairs (2i, 2i + 1); 0: pairs (i, i + rotary_dim / 2) (NeoX) */   \
    F(int32_t, threads)
typedef struct hal_cpu_rotary_embedding_args {
    HAL_CPU_ROTARY_EMBEDDING_FIELDS(HAL_CPU_DECLARE_FIELD)
} hal_cpu_rotary_embedding_args;

/* The names hal_cpu_abi knows, with their field lists: X(name, struct, FIELDS) per argument struct. */
/* The experts of a small mixture-of-experts call (fused_moe with a few rows per expert): job j is one expert's
 * y_j = w2_j(act(w13_j(x_j))) as three calls, its w13 GEMM (up[j]), its gated activation (act[j]) and its w2
 * GEMM (down[j]), each with its x and y (gate, up, out) filled and run on one thread (their threads fields are
 * ignored); the jobs are spread over `threads` threads. up and down are arrays of the kind's GEMM struct:
 * HAL_EXPERT_W4A16 hal_cpu_w4a16_gemv_args, HAL_EXPERT_W8A8 hal_cpu_w8a8_gemm_args, HAL_EXPERT_W4A8
 * hal_cpu_w4a8_gemm_args. Each output is what the three calls give one after the other (every kernel gives the
 * same bits at every thread count); HAL_ENOMEM if a job's kernel could not allocate (its outputs unspecified). */
enum { HAL_EXPERT_W4A16 = 0, HAL_EXPERT_W8A8 = 1, HAL_EXPERT_W4A8 = 2 };
#define HAL_CPU_EXPERT_MLPS_FIELDS(F)                                                                          \
    F(const void *, up)                 /* [jobs] of the kind's GEMM struct */                                 \
    F(const hal_cpu_gated_activation_args *, act) /* [jobs] */                                                \
    F(const void *, down)               /* [jobs] of the kind's GEMM struct */                                 \
    F(int64_t, jobs)                                                                                           \
    F(int32_t, kind)                    /* HAL_EXPERT_W4A16 / HAL_EXPERT_W8A8 / HAL_EXPERT_W4A8 */             \
    F(int32_t, threads)
typedef struct hal_cpu_expert_mlps_args { HAL_CPU_EXPERT_MLPS_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_expert_mlps_args;

/* A whole small mixture-of-experts call from its routing: the (token, expert) pairs of ids/weights grouped by
 * expert (token order kept within each), each hit expert's rows gathered from x, its y = w2(act(w13(x))) run as
 * by hal_cpu_expert_mlps from the GEMM structs kept for it, and out[t] = sum over t's experts in increasing
 * order of y * weight (each product rounded to float32, then added to a sum that starts at 0). The GEMM structs
 * are tables per rows-per-expert n: up[n - 1] and down[n - 1] point at num_experts structs of the kind (every
 * field filled but x and y, their m being n), ready[n - 1][e] is 1 where expert e's are; a NULL table holds none.
 * Returns HAL_OK (out written), HAL_ENOMEM, or HAL_DECLINED with out untouched: fewer experts hit than threads,
 * an expert with more than max_rows rows, a struct not ready, an expert id out of range, or (HAL_EXPERT_W4A16,
 * whose in-register kernel factors zero points out of its sums) an expert's output holding a non-finite value. */
enum { HAL_DECLINED = 2 };
#define HAL_CPU_MOE_EXPERTS_FIELDS(F)                                                                          \
    F(const void *, x)                  /* [tokens] rows of hidden elements, x_stride elements apart */         \
    F(int64_t, x_stride)                                                                                       \
    F(const int64_t *, ids)             /* [tokens, top_k], ids_stride apart: expert ids, distinct in a row */  \
    F(int64_t, ids_stride)                                                                                     \
    F(const float *, weights)           /* [tokens, top_k], weights_stride apart: routing weights */            \
    F(int64_t, weights_stride)                                                                                 \
    F(float *, out)                     /* [tokens, hidden] float32, contiguous */                              \
    F(const void *const *, up)          /* [max_rows] tables of [num_experts] w13 GEMM structs, or NULL */      \
    F(const void *const *, down)        /* [max_rows] tables of [num_experts] w2 GEMM structs, or NULL */       \
    F(const uint8_t *const *, ready)    /* [max_rows] of [num_experts] flags, or NULL */                        \
    F(int64_t, tokens)                                                                                         \
    F(int64_t, top_k)                                                                                          \
    F(int64_t, num_experts)                                                                                    \
    F(int64_t, hidden)                                                                                         \
    F(int64_t, intermediate_size)                                                                              \
    F(int32_t, x_itemsize)              /* bytes per element of x (the GEMM structs' x_dtype says which) */     \
    F(int32_t, max_rows)                                                                                       \
    F(int32_t, kind)                    /* HAL_EXPERT_W4A16 / HAL_EXPERT_W8A8 / HAL_EXPERT_W4A8 */             \
    F(int32_t, activation)              /* HAL_ACT_SILU / HAL_ACT_GELU / HAL_ACT_GELU_TANH */                  \
    F(int32_t, threads)
typedef struct hal_cpu_moe_experts_args { HAL_CPU_MOE_EXPERTS_FIELDS(HAL_CPU_DECLARE_FIELD) } hal_cpu_moe_experts_args;

#define HAL_CPU_ABI_STRUCTS(X)                                                                                 \
    X(attention, hal_cpu_attention_args, HAL_CPU_ATTENTION_FIELDS)                                             \
    X(write_kv_cache, hal_cpu_write_kv_cache_args, HAL_CPU_WRITE_KV_CACHE_FIELDS)                              \
    X(to_float32, hal_cpu_to_float32_args, HAL_CPU_TO_FLOAT32_FIELDS)                                          \
    X(w4a16_gemv, hal_cpu_w4a16_gemv_args, HAL_CPU_W4A16_GEMV_FIELDS)                                          \
    X(dequant_tile, hal_cpu_dequant_tile_args, HAL_CPU_DEQUANT_TILE_FIELDS)                                    \
    X(w8a8_gemm, hal_cpu_w8a8_gemm_args, HAL_CPU_W8A8_GEMM_FIELDS)                                             \
    X(w4a16_blocked, hal_cpu_w4a16_blocked_args, HAL_CPU_W4A16_BLOCKED_FIELDS)                                 \
    X(w4a8_gemm, hal_cpu_w4a8_gemm_args, HAL_CPU_W4A8_GEMM_FIELDS)                                             \
    X(sample, hal_cpu_sample_args, HAL_CPU_SAMPLE_FIELDS)                                                      \
    X(rms_norm, hal_cpu_rms_norm_args, HAL_CPU_RMS_NORM_FIELDS)                                                \
    X(gated_activation, hal_cpu_gated_activation_args, HAL_CPU_GATED_ACTIVATION_FIELDS)                        \
    X(rotary_embedding, hal_cpu_rotary_embedding_args, HAL_CPU_ROTARY_EMBEDDING_FIELDS)                        \
    X(from_float32, hal_cpu_from_float32_args, HAL_CPU_FROM_FLOAT32_FIELDS)                                    \
    X(expert_mlps, hal_cpu_expert_mlps_args, HAL_CPU_EXPERT_MLPS_FIELDS)                                       \
    X(moe_experts, hal_cpu_moe_experts_args, HAL_CPU_MOE_EXPERTS_FIELDS)

/* "size=N;field=offset:size;..." for an argument struct of this ABI (the names of HAL_CPU_ABI_STRUCTS), NULL
 * for an unknown name: hal_cpu._abi compares it with its ctypes mirror when the library loads. */
const char *hal_cpu_abi(const char *name);

/* Every kernel returns HAL_OK, or HAL_ENOMEM (nothing written to its outputs). */
int hal_cpu_paged_attention(const hal_cpu_attention_args *args);

/* Whether bf16/fp16 prefill attention runs on AMX tiles here (1: the CPU has AMX-BF16, the OS granted the tile
 * state, and it is not turned off) or on vector FMAs (0). */
int hal_cpu_attention_amx(void);
/* Allows (1, the default) or forbids (0) AMX in this process, for attention and for the integer GEMMs
 * (hal_cpu_gemm_amx); returns the previous setting. */
int hal_cpu_set_attention_amx(int enabled);
/* Whether W4A8 and W8A8 (hal_cpu_w4a8_gemm, hal_cpu_w8a8_gemm) with many rows run on AMX-INT8 tiles here (1: the selected variant has the
 * tile path, the CPU has AMX-INT8, the OS granted the tile state, and AMX is not turned off) or on vector dot
 * products (0). */
int hal_cpu_gemm_amx(void);

int hal_cpu_write_kv_cache(const hal_cpu_write_kv_cache_args *args);
int hal_cpu_to_float32(const hal_cpu_to_float32_args *args);
int hal_cpu_w4a16_gemv(const hal_cpu_w4a16_gemv_args *args);
int hal_cpu_dequant_tile(const hal_cpu_dequant_tile_args *args);
int hal_cpu_w8a8_gemm(const hal_cpu_w8a8_gemm_args *args);
int hal_cpu_w4a16_blocked(const hal_cpu_w4a16_blocked_args *args);
int hal_cpu_w4a8_gemm(const hal_cpu_w4a8_gemm_args *args);
int hal_cpu_sample(const hal_cpu_sample_args *args);
int hal_cpu_rms_norm(const hal_cpu_rms_norm_args *args);
int hal_cpu_gated_activation(const hal_cpu_gated_activation_args *args);
int hal_cpu_rotary_embedding(const hal_cpu_rotary_embedding_args *args);
int hal_cpu_from_float32(const hal_cpu_from_float32_args *args);
int hal_cpu_expert_mlps(const hal_cpu_expert_mlps_args *args);
int hal_cpu_moe_experts(const hal_cpu_moe_experts_args *args);

/* 1 when hal_cpu_w4a16_gemv runs fp16/bf16 activations through AVX512_BF16 dot products on this CPU, else 0. */
int hal_cpu_w4a16_half_dot(void);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif
