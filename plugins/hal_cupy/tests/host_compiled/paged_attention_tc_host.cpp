// Host entry points for paged_attention_tc.cu (tensor-core attention): the
// launcher of hal_paged_attention_tc and the static shared memory it declares.
// Compiled after the translation unit of paged_attention_tc.cu (harness.py hands it to g++ with -include):
// the host prelude, then paged_attention_tc.cu with its hal headers inlined, as the GPU compilers get it.

extern "C" int launch_hal_paged_attention_tc(
    const unsigned* grid, const unsigned* block, void* out, float* tmp_out, float* max_logits, float* exp_sums,
    const void* query, const void* key_cache, const void* value_cache, const int* block_tables,
    const int* seq_lens, const int* query_start_loc, const float* sinks, const float* alibi_slopes, float scale,
    float softcap, int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, int window,
    int num_tokens, int max_query_len, long long ksb, long long ksh, long long kst, long long vsb, long long vsh,
    long long vst, int partition_size, int max_partitions, int num_blocks, int max_seq_len, int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_paged_attention_tc((hal_t*)out, tmp_out, max_logits, exp_sums, (const hal_t*)query,
                               (const hal_t*)key_cache, (const hal_t*)value_cache, block_tables, seq_lens,
                               query_start_loc, sinks, alibi_slopes, scale, softcap, num_heads, num_kv_heads,
                               block_size, max_blocks_per_seq, window, num_tokens, max_query_len, ksb, ksh, kst,
                               vsb, vsh, vst, partition_size, max_partitions, num_blocks, max_seq_len, error_flag);
    });
}

// Shared plus the index checks' ints (hal_block_table_ok; the HAL_VARLEN build hal_query_starts_ok too).
extern "C" int static_shared_bytes() { return (int)(sizeof(pa_tc::Shared) + (HAL_VARLEN ? 2 : 1) * sizeof(int)); }
