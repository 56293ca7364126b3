// Host entry points for quant_util.cu (grid and block as 3-element arrays,
// then the kernel's parameters in order).
// Compiled after the translation unit of quant_util.cu (harness.py hands it to g++ with -include):
// the host prelude, then quant_util.cu with its hal headers inlined, as the GPU compilers get it.

extern "C" int launch_hal_w4a16_dequant(const unsigned* grid, const unsigned* block, void* w,
                                        const void* qweight, const void* scales, const void* zeros,
                                        int K, int N, int group_size) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w4a16_dequant((hal_t*)w, (const hal_u32*)qweight, (const hal_u16*)scales,
                          (const hal_u8*)zeros, K, N, group_size);
    });
}

extern "C" int launch_hal_w8_dequant(const unsigned* grid, const unsigned* block, void* w,
                                     const void* qweight, const void* scales, const void* zeros,
                                     int K, int N, int group_size) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w8_dequant((hal_t*)w, (const hal_u8*)qweight, (const hal_u16*)scales,
                       (const hal_u8*)zeros, K, N, group_size);
    });
}

extern "C" int launch_hal_w8a8_quantize_rows(const unsigned* grid, const unsigned* block, void* xq,
                                             float* sx, const void* x, int K) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w8a8_quantize_rows((hal_i8*)xq, sx, (const hal_t*)x, K);
    });
}

extern "C" int launch_hal_w4a8_quantize_rows(const unsigned* grid, const unsigned* block, void* xq,
                                             float* sx, const void* x, int K) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w4a8_quantize_rows((hal_i8*)xq, sx, (const hal_t*)x, K);
    });
}

extern "C" int launch_hal_f32_to_dtype(const unsigned* grid, const unsigned* block, void* out,
                                       const float* ws, long long count) {
    return hal_host::launch_lambda(grid, block,
                                   [=] { hal_f32_to_dtype((hal_t*)out, ws, count); });
}

extern "C" int launch_hal_f32_splits_to_dtype(const unsigned* grid, const unsigned* block, void* out,
                                              const float* ws, long long count, int splits) {
    return hal_host::launch_lambda(grid, block,
                                   [=] { hal_f32_splits_to_dtype((hal_t*)out, ws, count, splits); });
}
