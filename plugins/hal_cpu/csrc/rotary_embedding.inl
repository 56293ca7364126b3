// rotary_embedding.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// Rotary position embedding in place: each head row's first rotary_dim values rotated pair by pair by its
// token's cos/sin row, in float32, rounded once to the storage dtype. NeoX pairs (i, i + half) are loaded as
// vectors straight from the row; GPT-J pairs (2i, 2i + 1) are split into two float runs first, rotated with the
// same vector code and interleaved back (a bounded stack buffer; nothing is allocated). Tasks are runs of (token, head) rows, query heads then key heads.
// ---------------------------------------------------------------------------------------------

// v's W lanes stored at p in S's dtype (round to nearest even; NaN stays NaN).
template <class S>
inline void store_as(typename S::T *p, V::f v) {
    if constexpr (std::is_same_v<S, F32>) {
        V::store(p, v);
    } else {
        alignas(64) float tmp[W];
        V::store(tmp, v);
#if defined(HAL_HALF_LANES)
        if constexpr (std::is_same_v<S, F16>) f16_rne_lanes(tmp, p);
        else bf16_rne_lanes(tmp, p, false);  // the bits of f32_to_bf16_bits, W lanes at a time
#else
        for (int l = 0; l < W; ++l)
            p[l] = std::is_same_v<S, F16> ? f32_to_f16_bits(tmp[l]) : f32_to_bf16_bits(tmp[l]);
#endif
    }
}

template <class S>
inline void store_one(typename S::T *p, float v) {
    if constexpr (std::is_same_v<S, F32>) *p = v;
    else *p = std::is_same_v<S, F16> ? f32_to_f16_bits(v) : f32_to_bf16_bits(v);
}

// (a, b) <- (a * c - b * s, b * c + a * s) for float runs of n pairs.
inline void rotate_floats(float *a, float *b, const float *cos, const float *sin, int n) {
    int i = 0;
    for (; i + W <= n; i += W) {
        const V::f x1 = V::load(a + i), x2 = V::load(b + i), c = V::load(cos + i), s = V::load(sin + i);
        V::store(a + i, V::fnma(x2, s, V::mul(x1, c)));
        V::store(b + i, V::fma(x1, s, V::mul(x2, c)));
    }
    for (; i < n; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

// One NeoX row: pairs (x[i], x[i + half]).
template <class S>
inline void rotate_neox(typename S::T *x, const float *cos, const float *sin, int half) {
    int i = 0;
    for (; i + W <= half; i += W) {
        const V::f x1 = vload<S>(x + i), x2 = vload<S>(x + half + i), c = V::load(cos + i), s = V::load(sin + i);
        store_as<S>(x + i, V::fnma(x2, s, V::mul(x1, c)));
        store_as<S>(x + half + i, V::fma(x1, s, V::mul(x2, c)));
    }
    for (; i < half; ++i) {
        const float x1 = S::scalar(x + i), x2 = S::scalar(x + half + i);
        store_one<S>(x + i, x1 * cos[i] - x2 * sin[i]);
        store_one<S>(x + half + i, x2 * cos[i] + x1 * sin[i]);
    }
}

// One GPT-J row: pairs (x[2i], x[2i + 1]), split into two float runs of at most kRotaryChunk pairs at a time.
constexpr int kRotaryChunk = 128;
template <class S>
inline void rotate_gptj(typename S::T *x, const float *cos, const float *sin, int half) {
    float a[kRotaryChunk], b[kRotaryChunk];
    for (int i0 = 0; i0 < half; i0 += kRotaryChunk) {
        const int n = std::min(kRotaryChunk, half - i0);
        typename S::T *y = x + 2 * i0;
        for (int i = 0; i < n; ++i) {
            a[i] = S::scalar(y + 2 * i);
            b[i] = S::scalar(y + 2 * i + 1);
        }
        rotate_floats(a, b, cos + i0, sin + i0, n);
        for (int i = 0; i < n; ++i) {
            store_one<S>(y + 2 * i, a[i]);
            store_one<S>(y + 2 * i + 1, b[i]);
        }
    }
}

template <class S>
int rotary_embedding_typed(const hal_cpu_rotary_embedding_args &a) {
    using T = typename S::T;
    const int32_t heads = a.num_heads, kv_heads = a.key ? a.num_kv_heads : 0, row_heads = heads + kv_heads;
    const int half = a.rotary_dim / 2;
    const int64_t rows = a.num_tokens * row_heads;
    const int64_t per_task = 64;
    parallel_for((rows + per_task - 1) / per_task, a.threads, [&](int64_t task) {
        const int64_t r1 = std::min(rows, (task + 1) * per_task);
        for (int64_t r = task * per_task; r < r1; ++r) {
            const int64_t t = r / row_heads;
            const int32_t h = int32_t(r - t * row_heads);
            const int64_t pos = a.position_bytes == 8 ? static_cast<const int64_t *>(a.positions)[t]
                                                      : static_cast<const int32_t *>(a.positions)[t];
            if (pos < 0 || pos >= a.max_position) continue;  // validated on the host; never read out of the table
            const float *cos = a.cos_sin_cache + pos * int64_t(a.rotary_dim), *sin = cos + half;
            T *x = h < heads ? static_cast<T *>(a.query) + t * a.q_token_stride + h * a.q_head_stride
                             : static_cast<T *>(a.key) + t * a.k_token_stride + (h - heads) * a.k_head_stride;
            if (a.gptj) rotate_gptj<S>(x, cos, sin, half);
            else rotate_neox<S>(x, cos, sin, half);
        }
    });
    return HAL_OK;
}

int rotary_embedding(const hal_cpu_rotary_embedding_args *args) {
    if (args->dtype == HAL_F16) return rotary_embedding_typed<F16>(*args);
    if (args->dtype == HAL_BF16) return rotary_embedding_typed<BF16>(*args);
    return rotary_embedding_typed<F32>(*args);
}
