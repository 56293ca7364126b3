// gated_activation.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// out = act(gate) * up for a gated MLP (hal-core's gated_activation contract)
// ---------------------------------------------------------------------------------------------
// Each row is read once in blocks of kNormBlock elements converted to float32 on the stack; the activation runs in
// W lanes and the product is rounded once into out. Activation codes: HAL_ACT_SILU, HAL_ACT_GELU, HAL_ACT_GELU_TANH.

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

template <int Act>
inline void gated_activation_rows(const hal_cpu_gated_activation_args &a, int64_t r0, int64_t r1) {
    alignas(64) float g[kNormBlock];
    alignas(64) float u[kNormBlock];
    const int64_t d = a.intermediate_size;
    for (int64_t r = r0; r < r1; ++r) {
        const void *gate = row_ptr(a.gate, a.dtype, r, a.gate_stride);
        const void *up = row_ptr(a.up, a.dtype, r, a.up_stride);
        void *out = elem_ptr(a.out, a.dtype, r * a.out_stride);
        for (int64_t c = 0; c < d; c += kNormBlock) {
            const int n = int(std::min<int64_t>(kNormBlock, d - c));
            const int padded = load_block(row_ptr(gate, a.dtype, c, 1), a.dtype, n, g);
            load_block(row_ptr(up, a.dtype, c, 1), a.dtype, n, u);
            for (int e = 0; e < padded; e += W) {
                const V::f gv = V::load(g + e);
                const V::f act = Act == HAL_ACT_GELU ? vgelu(gv)
                                 : Act == HAL_ACT_GELU_TANH ? vgelu_tanh(gv) : V::mul(gv, vsigmoid(gv));
                V::store(g + e, V::mul(act, V::load(u + e)));
            }
            store_row(g, n, elem_ptr(out, a.dtype, c), a.dtype);
        }
    }
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
