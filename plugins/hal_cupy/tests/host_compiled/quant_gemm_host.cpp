// Host entry points for quant_gemm.cu: the GEMM of the HAL_QBITS build (grid
// and block as 3-element arrays, then the kernel's parameters in order) and
// the static shared memory it declares, for the host rule check.
// Compiled after the translation unit of quant_gemm.cu (harness.py hands it to g++ with -include):
// the host prelude, then quant_gemm.cu with its hal headers inlined, as the GPU compilers get it.

#if HAL_QBITS == 4
extern "C" int launch_hal_w4a16_gemm(const unsigned* grid, const unsigned* block, void* out,
                                     float* ws, const void* x, const void* qweight,
                                     const void* scales, const void* zeros, int M, int N, int K,
                                     int group_size, int groups_per_split) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w4a16_gemm((hal_t*)out, ws, (const hal_t*)x, (const hal_u32*)qweight,
                       (const hal_u16*)scales, (const hal_u8*)zeros, M, N, K, group_size,
                       groups_per_split);
    });
}
#else
extern "C" int launch_hal_w8a8_gemm(const unsigned* grid, const unsigned* block, void* out,
                                    float* ws, const void* xq, const float* sx, const void* qweight,
                                    const void* scales, const void* zeros, int M, int N, int K,
                                    int group_size, int groups_per_split) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_w8a8_gemm((hal_t*)out, ws, (const hal_i8*)xq, sx, (const hal_u8*)qweight,
                      (const hal_u16*)scales, (const hal_u8*)zeros, M, N, K, group_size,
                      groups_per_split);
    });
}
#endif

// s_red of the GEMM kernels.
extern "C" int static_shared_bytes() { return (int)sizeof(float) * qg::MT * qg::COLS; }
