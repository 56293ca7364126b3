// gated_activation.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// out = act(gate) * up for a gated MLP (hal-core's gated_activation contract)
// ---------------------------------------------------------------------------------------------
// Each row is read once, W lanes at a time converted to float32 in registers; the activation runs in W lanes and
// the product is rounded once into out. Activation codes: HAL_ACT_SILU, HAL_ACT_GELU, HAL_ACT_GELU_TANH.

// sigmoid(v) = 1 / (1 + e^-v) through e = exp(-|v|) (V::exp takes arguments <= 0): v >= 0: 1 / (1 + e), else
// e / (1 + e). A NaN v gives NaN.
inline V::f vsigmoid(V::f v) {
    const V::f one = V::set1(1.0f);
    const V::f e = V::exp(V::sub(V::zero(), V::abs(v)));
    return V::div(V::select_le(V::zero(), v, one, e), V::add(one, e));
}

// The exact GELU, 0.5 g (1 + erf(g / sqrt 2)), with erfc(z) for z = |g| / sqrt 2 from Abramowitz and Stegun 7.1.26
// (|error| < 1.5e-7): q = erfc(z); g >= 0: g (1 - q / 2), else g q / 2.
inline V::f vgelu(V::f g) {
    const V::f z = V::mul(V::abs(g), V::set1(0.70710678118654752f));
    const V::f t = V::div(V::set1(1.0f), V::fma(V::set1(0.3275911f), z, V::set1(1.0f)));
    V::f p = V::set1(1.061405429f);
    p = V::fma(p, t, V::set1(-1.453152027f));
    p = V::fma(p, t, V::set1(1.421413741f));
    p = V::fma(p, t, V::set1(-0.284496736f));
    p = V::fma(p, t, V::set1(0.254829592f));
    const V::f q = V::mul(V::mul(p, t), V::exp(V::sub(V::zero(), V::mul(z, z))));
    const V::f half_q = V::mul(V::set1(0.5f), q);
    return V::mul(g, V::select_le(V::zero(), g, V::sub(V::set1(1.0f), half_q), half_q));
}

// The tanh GELU: 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3).
inline V::f vgelu_tanh(V::f g) {
    const V::f g3 = V::mul(V::mul(g, g), g);
    const V::f two_u = V::mul(V::set1(1.5957691216057308f), V::fma(V::set1(0.044715f), g3, g));
    return V::mul(g, vsigmoid(two_u));
}

// act(g) in W lanes. SiLU is g / (1 + e^-g), the reference's own form (one exp and one division, no select):
// e^-g overflows to inf for g below the float range, giving -0 (the reference's value rounds to a subnormal or
// -0), and g = -inf gives NaN, as the reference's -inf / inf.
template <int Act>
inline V::f activate(V::f g) {
    if (Act == HAL_ACT_GELU) return vgelu(g);
    if (Act == HAL_ACT_GELU_TANH) return vgelu_tanh(g);
    return V::div(g, V::add(V::set1(1.0f), V::exp(V::sub(V::zero(), g))));
}

// One row, W lanes at a time straight from gate and up (converted in registers): a float32 row is written
// directly, an fp16/bf16 one through a block of float32 results rounded once (store_row). The last partial
// vector goes through zero-padded lanes.
template <class S, int Act>
inline void gated_row(const typename S::T *gate, const typename S::T *up, void *out, int32_t dtype, int64_t d) {
    alignas(64) float block[kNormBlock];
    for (int64_t c = 0; c < d; c += kNormBlock) {
        const int n = int(std::min<int64_t>(kNormBlock, d - c));
        const typename S::T *gc = gate + c, *uc = up + c;
        float *dst = dtype == HAL_F32 ? static_cast<float *>(out) + c : block;
        int e = 0;
        for (; e + W <= n; e += W) V::store(dst + e, V::mul(activate<Act>(vload<S>(gc + e)), vload<S>(uc + e)));
        if (e < n) {  // load_tail: rms_norm.inl's zero-padded lanes
            alignas(64) float lanes[W];
            V::store(lanes, V::mul(activate<Act>(load_tail<S>(gc + e, n - e)), load_tail<S>(uc + e, n - e)));
            std::memcpy(dst + e, lanes, sizeof(float) * size_t(n - e));
        }
        if (dtype != HAL_F32) store_row(block, n, elem_ptr(out, dtype, c), dtype);
    }
}

template <class S, int Act>
inline void gated_activation_rows(const hal_cpu_gated_activation_args &a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
        gated_row<S, Act>(static_cast<const typename S::T *>(row_ptr(a.gate, a.dtype, r, a.gate_stride)),
                          static_cast<const typename S::T *>(row_ptr(a.up, a.dtype, r, a.up_stride)),
                          elem_ptr(a.out, a.dtype, r * a.out_stride), a.dtype, a.intermediate_size);
}

template <int Act>
inline void gated_activation_rows(const hal_cpu_gated_activation_args &a, int64_t r0, int64_t r1) {
    if (a.dtype == HAL_F32) gated_activation_rows<F32, Act>(a, r0, r1);
    else if (a.dtype == HAL_F16) gated_activation_rows<F16, Act>(a, r0, r1);
    else gated_activation_rows<BF16, Act>(a, r0, r1);
}

int gated_activation(const hal_cpu_gated_activation_args *args) {
    const hal_cpu_gated_activation_args &a = *args;
    const int64_t per_task = std::max<int64_t>(1, a.rows_per_task);
    parallel_for((a.num_tokens + per_task - 1) / per_task, a.threads, [&](int64_t t) {
        const int64_t r0 = t * per_task, r1 = std::min(a.num_tokens, r0 + per_task);
        if (a.activation == HAL_ACT_GELU) gated_activation_rows<HAL_ACT_GELU>(a, r0, r1);
        else if (a.activation == HAL_ACT_GELU_TANH) gated_activation_rows<HAL_ACT_GELU_TANH>(a, r0, r1);
        else gated_activation_rows<HAL_ACT_SILU>(a, r0, r1);
    });
    return HAL_OK;
}
