// Host entry point for sample.cu (grid and block as 3-element arrays, then the kernel's parameters in order).
// Compiled after the translation unit of sample.cu (harness.py hands it to g++ with -include): the host
// prelude, then sample.cu with its hal headers inlined, as the GPU compilers get it.

extern "C" int launch_hal_sample(const unsigned* grid, const unsigned* block, const void* logits,
                                 long long row_stride, int vocab, const void* temperature, const void* top_k,
                                 const void* top_p, const void* min_p, const void* seeds, void* out,
                                 int* error_flag) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_sample((const hal_t*)logits, row_stride, vocab, (const float*)temperature, (const int*)top_k,
                   (const float*)top_p, (const float*)min_p, (const hal_i64*)seeds, (hal_i64*)out, error_flag);
    });
}
