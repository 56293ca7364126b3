// Host entry points for paged_attention.cu: one extern "C" launcher per kernel
// (grid and block as 3-element arrays, then the kernel's parameters in order)
// and the static shared memory the kernels declare, for the host rule check.
// Compiled after the translation unit of paged_attention.cu (harness.py hands it to g++ with -include):
// the host prelude, then paged_attention.cu with its hal headers inlined, as the GPU compilers get it.

#define HOST_PA_PARAMS                                                                                            \
    const void *query, const void *key_cache, const void *value_cache, const int *block_tables,                   \
        const int *seq_lens, const int *query_start_loc, const float *sinks, const float *alibi_slopes,           \
        float scale, float softcap, int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq,      \
        int window, int num_tokens, int max_query_len, long long ksb, long long ksh, long long kst, long long vsb, \
        long long vsh, long long vst
#define HOST_PA_ARGS                                                                                              \
    (const hal_t*)query, (const hal_t*)key_cache, (const hal_t*)value_cache, block_tables, seq_lens,             \
        query_start_loc, sinks, alibi_slopes, scale, softcap, num_heads, num_kv_heads, block_size,               \
        max_blocks_per_seq, window, num_tokens, max_query_len, ksb, ksh, kst, vsb, vsh, vst

extern "C" int launch_hal_paged_attention(const unsigned* grid, const unsigned* block, void* out, HOST_PA_PARAMS,
                                          int num_blocks, int max_seq_len, int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_paged_attention((hal_t*)out, HOST_PA_ARGS, num_blocks, max_seq_len, error_flag);
    });
}

extern "C" int launch_hal_paged_attention_split(const unsigned* grid, const unsigned* block, float* tmp_out,
                                                float* max_logits, float* exp_sums, HOST_PA_PARAMS,
                                                int partition_size, int max_partitions, int num_blocks,
                                                int max_seq_len, int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_paged_attention_split(tmp_out, max_logits, exp_sums, HOST_PA_ARGS, partition_size, max_partitions,
                                  num_blocks, max_seq_len, error_flag);
    });
}

extern "C" int launch_hal_paged_attention_reduce(const unsigned* grid, const unsigned* block, void* out,
                                                 const float* tmp_out, const float* max_logits,
                                                 const float* exp_sums, const int* seq_lens,
                                                 const int* query_start_loc, const float* sinks, int num_heads,
                                                 int num_seqs, int max_query_len, int partition_size,
                                                 int max_partitions) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_paged_attention_reduce((hal_t*)out, tmp_out, max_logits, exp_sums, seq_lens, query_start_loc, sinks,
                                   num_heads, num_seqs, max_query_len, partition_size, max_partitions);
    });
}

// s_logit + s_out + s_m/s_l/s_alpha of the attention kernels (the index checks' two ints come on top).
extern "C" int static_shared_bytes() {
    return (int)sizeof(float) * (pa::GQA * pa::CHUNK + pa::GQA * pa::HS + 3 * pa::GQA) + 2 * (int)sizeof(int);
}
