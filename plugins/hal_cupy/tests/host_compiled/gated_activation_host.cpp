// Host entry point for gated_activation.cu (grid and block as 3-element arrays, then the kernel's parameters in
// order).  Compiled after the translation unit of gated_activation.cu (harness.py hands it to g++ with -include).

extern "C" int launch_hal_gated_activation(const unsigned* grid, const unsigned* block, void* out, const void* gate,
                                           const void* up, long long gate_stride, long long up_stride,
                                           int intermediate_size, int activation) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_gated_activation(out, gate, up, gate_stride, up_stride, intermediate_size, activation);
    });
}
