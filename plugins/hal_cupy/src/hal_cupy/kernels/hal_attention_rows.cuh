// The rows of the paged-attention kernels (paged_attention.cu, paged_attention_tc.cu): their shared
// parameters, which (new token, query head) rows a CTA takes, the keys those rows see, and the index checks.
//
// Sequence s has q_len new tokens (query rows query_start_loc[s] ..; one row s without query_start_loc) and each
// KV head serves `group` query heads, so s has q_len * group rows per KV head, token-major (row r is new token
// r / group, query head kv_head * group + r % group).  CTA (x, s, p) of a kernel with ROWS rows per CTA takes
// rows [tile * ROWS, ...) of KV head x / tiles (tile = x % tiles, tiles = ceil(max_query_len * group / ROWS)).
// New token i sits at position L - q_len + i (L = seq_lens[s]) and sees the keys t <= position, the last
// `window` of them with a window (> 0).
#pragma once

namespace pa_rows {

// The kernels' shared parameters (in the order they are passed).
struct Args {
    const hal_t* HAL_RESTRICT query;
    const hal_t* HAL_RESTRICT key_cache;
    const hal_t* HAL_RESTRICT value_cache;
    const int* HAL_RESTRICT block_tables;
    const int* HAL_RESTRICT seq_lens;
    const int* HAL_RESTRICT query_start_loc;  // null: one new token per sequence (row s)
    const float* HAL_RESTRICT sinks;          // null: none
    const float* HAL_RESTRICT alibi_slopes;   // null: none
    float scale, softcap;                     // softcap 0: none
    int num_heads, num_kv_heads, block_size, max_blocks_per_seq, window, num_tokens, max_query_len;
    hal_i64 k_stride[3], v_stride[3];  // elements between blocks, KV heads, tokens
};

// One CTA's rows and the keys they see.
struct Tile {
    int s, kv_head, r0, n_rows;  // rows [r0, r0 + n_rows) of the sequence's q_len * group rows
    int q0, q_len, seq_len;      // first query row, new tokens, keys
    bool rows_known;             // query_start_loc places this sequence's rows (its own entries are sane)
    int lo, hi;                  // union of the rows' visible keys [lo, hi)
};

HAL_DEVICE int row_position(const Tile& tl, int group, int r) { return tl.seq_len - tl.q_len + r / group; }
HAL_DEVICE int row_first_key(const Args& a, int pos) {
    return a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
}
HAL_DEVICE hal_i64 row_index(const Args& a, const Tile& tl, int group, int r) {  // query/out row * heads + head
    return ((hal_i64)tl.q0 + r / group) * a.num_heads + (hal_i64)tl.kv_head * group + r % group;
}

template <int ROWS>
HAL_DEVICE Tile make_tile(const Args& a) {
    Tile tl;
    const int group = a.num_heads / a.num_kv_heads;
    const int tiles = (a.max_query_len * group + ROWS - 1) / ROWS;
    tl.s = blockIdx.y;
    tl.kv_head = blockIdx.x / tiles;
    tl.r0 = (blockIdx.x % tiles) * ROWS;
    tl.seq_len = a.seq_lens[tl.s];
    if (a.query_start_loc == 0) {
        tl.q0 = tl.s;
        tl.q_len = 1;
        tl.rows_known = true;
    } else {
        tl.q0 = a.query_start_loc[tl.s];
        const int q1 = a.query_start_loc[tl.s + 1];
        tl.q_len = q1 - tl.q0;
        tl.rows_known = tl.q0 >= 0 && q1 >= tl.q0 && q1 <= a.num_tokens && tl.q_len <= a.max_query_len;
    }
    const int rows = tl.rows_known ? tl.q_len * group - tl.r0 : 0;
    tl.n_rows = rows < ROWS ? (rows > 0 ? rows : 0) : ROWS;
    tl.lo = 0;
    tl.hi = 0;
    if (tl.n_rows > 0) {
        tl.lo = row_first_key(a, row_position(tl, group, tl.r0));
        tl.hi = row_position(tl, group, tl.r0 + tl.n_rows - 1) + 1;
    }
    return tl;
}

// 0 when keys [t0, t1) of the tile's sequence may be read, else the error code, reported by thread 0:
// query_start_loc sane and q_len <= min(L, max_query_len), L in [0, min(max_seq_len, table capacity)], the
// table entries of those keys in [0, num_blocks).  Cooperative: every thread of the CTA calls it.
HAL_DEVICE int check_indices(const Args& a, const Tile& tl, const int* HAL_RESTRICT table, int t0, int t1,
                             int num_blocks, int max_seq_len, int* error_flag, int nthreads) {
    const int capacity = a.max_blocks_per_seq * a.block_size;
    const int limit = max_seq_len < capacity ? max_seq_len : capacity;
    int code = 0;
    if (a.query_start_loc != 0 &&
        (!hal_query_starts_ok(a.query_start_loc, (int)gridDim.y, a.num_tokens, nthreads) || !tl.rows_known ||
         tl.q_len > tl.seq_len))
        code = HAL_ERR_QUERY_START_LOC;
    if (tl.seq_len < 0 || tl.seq_len > limit)
        code |= HAL_ERR_SEQ_LENS;
    else if (code == 0 && t1 > t0 &&
             !hal_block_table_ok(table, t0 / a.block_size, (t1 - 1) / a.block_size + 1, num_blocks, nthreads))
        code = HAL_ERR_BLOCK_TABLES;
    if (code != 0 && threadIdx.x == 0) hal_report_index_error(error_flag, code);
    return code;
}

}  // namespace pa_rows

// The parameters every paged-attention kernel takes after its outputs (README: `P`), and the Args they make.
#define HAL_PA_PARAMS                                                                                           \
    const hal_t *HAL_RESTRICT query, const hal_t *HAL_RESTRICT key_cache, const hal_t *HAL_RESTRICT value_cache, \
        const int *HAL_RESTRICT block_tables, const int *HAL_RESTRICT seq_lens,                                 \
        const int *HAL_RESTRICT query_start_loc, const float *HAL_RESTRICT sinks,                               \
        const float *HAL_RESTRICT alibi_slopes, float scale, float softcap, int num_heads, int num_kv_heads,     \
        int block_size, int max_blocks_per_seq, int window, int num_tokens, int max_query_len,                  \
        hal_i64 k_stride_block, hal_i64 k_stride_head, hal_i64 k_stride_token, hal_i64 v_stride_block,          \
        hal_i64 v_stride_head, hal_i64 v_stride_token
#define HAL_PA_ARGS                                                                                             \
    pa_rows::Args {                                                                                                  \
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sinks, alibi_slopes, scale,     \
            softcap, num_heads, num_kv_heads, block_size, max_blocks_per_seq, window, num_tokens,               \
            max_query_len, {k_stride_block, k_stride_head, k_stride_token},                                     \
            {v_stride_block, v_stride_head, v_stride_token}                                                     \
    }

