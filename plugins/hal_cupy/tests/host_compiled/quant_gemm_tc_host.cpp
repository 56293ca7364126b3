// Host entry points for quant_gemm_tc.cu: the tensor-core GEMM of the
// HAL_QBITS / HAL_ABITS build and the split reduction (grid and block as 3-element
// arrays, then the kernel's parameters in order), and the static shared
// memory the GEMM declares.
// Compiled after the translation unit of quant_gemm_tc.cu (harness.py hands it to g++ with -include):
// the host prelude, then quant_gemm_tc.cu with its hal headers inlined, as the GPU compilers get it.

#if HAL_ABITS == 16
extern "C" int launch_hal_w4a16_gemm_tc(const unsigned* grid, const unsigned* block, void* out, float* ws,
                                        const void* x, const void* qtc, const void* scales, const void* zeros,
                                        int M, int N, int K, int group_size, int kb_per_split) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w4a16_gemm_tc((hal_t*)out, ws, (const hal_t*)x, (const hal_u32*)qtc, (const hal_u16*)scales,
                          (const hal_u8*)zeros, M, N, K, group_size, kb_per_split);
    });
}
#elif HAL_QBITS == 4
extern "C" int launch_hal_w4a8_gemm_tc(const unsigned* grid, const unsigned* block, void* out, float* ws,
                                       const void* xq, const float* sx, const void* qtc, const void* scales,
                                       const void* zeros, int M, int N, int K, int group_size, int kb_per_split) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w4a8_gemm_tc((hal_t*)out, ws, (const hal_i8*)xq, sx, (const hal_u32*)qtc, (const hal_u16*)scales,
                         (const hal_u8*)zeros, M, N, K, group_size, kb_per_split);
    });
}
#else
extern "C" int launch_hal_w8a8_gemm_tc(const unsigned* grid, const unsigned* block, void* out, float* ws,
                                       const void* xq, const float* sx, const void* qtc, const void* scales,
                                       const void* zeros, int M, int N, int K, int group_size, int kb_per_split) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w8a8_gemm_tc((hal_t*)out, ws, (const hal_i8*)xq, sx, (const hal_u32*)qtc, (const hal_u16*)scales,
                         (const hal_u8*)zeros, M, N, K, group_size, kb_per_split);
    });
}
#endif

extern "C" int launch_hal_tc_reduce(const unsigned* grid, const unsigned* block, void* out, const float* ws,
                                    long long count, int splits) {
    return hal_host::launch_lambda(grid, block, [=] { hal_tc_reduce((hal_t*)out, ws, count, splits); });
}

extern "C" int static_shared_bytes() { return tc::STAGES * tc::STAGE_BYTES; }
