// Host entry point for rms_norm.cu (grid and block as 3-element arrays, then the kernel's parameters in order).
// Compiled after the translation unit of rms_norm.cu (harness.py hands it to g++ with -include).

extern "C" int launch_hal_rms_norm(const unsigned* grid, const unsigned* block, void* out, const void* x,
                                   const void* weight, void* residual, long long x_stride, long long residual_stride,
                                   int hidden_size, float epsilon, float weight_offset) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_rms_norm(out, x, weight, residual, x_stride, residual_stride, hidden_size, epsilon, weight_offset);
    });
}
