// Host entry point for rotary_embedding.cu (grid and block as 3-element arrays,
// then the kernel's parameters in order).
// Compiled after the translation unit of rotary_embedding.cu (harness.py hands it to g++ with -include):
// the host prelude, then rotary_embedding.cu with its hal headers inlined, as the GPU compilers get it.

extern "C" int launch_hal_rotary_embedding(const unsigned* grid, const unsigned* block, const void* positions,
                                           void* query, void* key, const float* cos_sin_cache,
                                           long long q_token_stride, long long q_head_stride,
                                           long long k_token_stride, long long k_head_stride, int num_heads,
                                           int num_kv_heads, int rotary_dim, int gptj, long long max_position,
                                           int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_rotary_embedding((const hal_pos_t*)positions, (hal_t*)query, (hal_t*)key, cos_sin_cache,
                             q_token_stride, q_head_stride, k_token_stride, k_head_stride, num_heads,
                             num_kv_heads, rotary_dim, gptj, max_position, error_flag);
    });
}
