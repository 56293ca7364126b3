// activations.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// activations to float32
// ---------------------------------------------------------------------------------------------

template <class S>
inline void row_to_f32(const typename S::T *x, int64_t k, float *out) {
    int64_t c = 0;
    for (; c + W <= k; c += W) V::store(out + c, vload<S>(x + c));
    for (; c < k; ++c) out[c] = S::scalar(x + c);
}

inline void any_row_to_f32(const void *x, int32_t dtype, int64_t k, float *out) {
    if (dtype == HAL_F16) row_to_f32<F16>(static_cast<const uint16_t *>(x), k, out);
    else if (dtype == HAL_BF16) row_to_f32<BF16>(static_cast<const uint16_t *>(x), k, out);
    else row_to_f32<F32>(static_cast<const float *>(x), k, out);
}

inline const void *row_ptr(const void *x, int32_t dtype, int64_t row, int64_t stride) {
    return static_cast<const char *>(x) + row * stride * (dtype == HAL_F32 ? 4 : 2);
}

int to_float32(const hal_cpu_to_float32_args *args) {
    const hal_cpu_to_float32_args &a = *args;
    parallel_for(a.m, a.threads,
                 [&](int64_t r) { any_row_to_f32(row_ptr(a.x, a.dtype, r, a.x_stride), a.dtype, a.k, a.out + r * a.k); });
    return HAL_OK;
}
