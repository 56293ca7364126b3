// Host entry point for write_kv_cache.cu (grid and block as 3-element arrays,
// then the kernel's parameters in order).
// Compiled after the translation unit of write_kv_cache.cu (harness.py hands it to g++ with -include):
// the host prelude, then write_kv_cache.cu with its hal headers inlined, as the GPU compilers get it.

extern "C" int launch_hal_write_kv_cache(const unsigned* grid, const unsigned* block,
                                         const void* key, const void* value, void* key_cache,
                                         void* value_cache, const void* slot_mapping,
                                         int num_kv_heads, int block_size, int row_bytes, int num_blocks,
                                         int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_write_kv_cache(key, value, key_cache, value_cache, (const hal_slot_t*)slot_mapping,
                           num_kv_heads, block_size, row_bytes, num_blocks, error_flag);
    });
}
