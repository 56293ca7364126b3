// rms_norm.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// RMSNorm with an optional fused residual add (hal-core's rms_norm contract)
// ---------------------------------------------------------------------------------------------
// Rows are read W lanes at a time straight from x, residual and weight (fp16/bf16 widened in registers; a row's
// last partial vector through zero-padded lanes). Per row: one pass reads x (and residual, writing the sum back in
// the dtype and, for fp16/bf16, re-reading the rounded sum) and sums the squares in W lanes; a second pass, over
// data the first left in cache, scales by rsqrt(mean + epsilon) and the weight and writes out (fp16/bf16 through a
// float32 block of kNormBlock elements rounded once). The lane sums are added in a fixed order: every thread count
// gives the same bits.

constexpr int kNormBlock = 512;  // a multiple of every variant's W

inline void *elem_ptr(void *base, int32_t dtype, int64_t offset) {
    return static_cast<char *>(base) + offset * (dtype == HAL_F32 ? 4 : 2);
}

// Lanes [e, e + W) of p (n valid from e, fewer than W: the rest read as zero).
template <class S>
inline V::f load_tail(const typename S::T *p, int valid) {
    alignas(64) float lanes[W];
    for (int l = 0; l < W; ++l) lanes[l] = l < valid ? S::scalar(p + l) : 0.0f;
    return V::load(lanes);
}

template <class S>
inline V::f load_lanes(const typename S::T *p, int valid) {
    return valid >= W ? vload<S>(p) : load_tail<S>(p, valid);
}

template <class S>
inline void rms_norm_row(const hal_cpu_rms_norm_args &a, int64_t r) {
    using T = typename S::T;
    alignas(64) float block[kNormBlock];
    const bool f32 = a.dtype == HAL_F32;
    const int64_t d = a.hidden_size;
    const T *x = static_cast<const T *>(row_ptr(a.x, a.dtype, r, a.x_stride));
    T *res = a.residual ? static_cast<T *>(elem_ptr(a.residual, a.dtype, r * a.residual_stride)) : nullptr;
    V::f ss = V::zero();
    for (int64_t c = 0; c < d; c += kNormBlock) {
        const int n = int(std::min<int64_t>(kNormBlock, d - c));
        if (res) {  // the sum, rounded to the dtype into residual, is what is normalised
            float *sum = f32 ? reinterpret_cast<float *>(res) + c : block;
            for (int e = 0; e < n; e += W) {
                const int valid = n - e;
                const V::f v = V::add(load_lanes<S>(x + c + e, valid), load_lanes<S>(res + c + e, valid));
                if (valid >= W) {
                    V::store(sum + e, v);
                } else {
                    alignas(64) float lanes[W];
                    V::store(lanes, v);
                    std::memcpy(sum + e, lanes, sizeof(float) * size_t(valid));
                }
                if (f32) ss = V::fma(v, v, ss);
            }
            if (!f32) {
                store_row(block, n, res + c, a.dtype);
                for (int e = 0; e < n; e += W) {
                    const V::f v = load_lanes<S>(res + c + e, n - e);  // the sum as stored (rounded)
                    ss = V::fma(v, v, ss);
                }
            }
        } else {
            for (int e = 0; e < n; e += W) {
                const V::f v = load_lanes<S>(x + c + e, n - e);
                ss = V::fma(v, v, ss);
            }
        }
    }
    const float scale = 1.0f / std::sqrt(V::hsum(ss) / float(d) + a.epsilon);
    const V::f vs = V::set1(scale), off = V::set1(a.weight_offset);
    const T *src = res ? res : x;
    const T *weight = static_cast<const T *>(a.weight);
    void *out = elem_ptr(a.out, a.dtype, r * a.out_stride);
    for (int64_t c = 0; c < d; c += kNormBlock) {
        const int n = int(std::min<int64_t>(kNormBlock, d - c));
        float *dst = f32 ? static_cast<float *>(out) + c : block;
        int e = 0;
        for (; e + W <= n; e += W)
            V::store(dst + e, V::mul(V::mul(vload<S>(src + c + e), vs), V::add(vload<S>(weight + c + e), off)));
        if (e < n) {
            alignas(64) float lanes[W];
            V::store(lanes, V::mul(V::mul(load_tail<S>(src + c + e, n - e), vs),
                                   V::add(load_tail<S>(weight + c + e, n - e), off)));
            std::memcpy(dst + e, lanes, sizeof(float) * size_t(n - e));
        }
        if (!f32) store_row(block, n, elem_ptr(out, a.dtype, c), a.dtype);
    }
}

inline void rms_norm_row(const hal_cpu_rms_norm_args &a, int64_t r) {
    if (a.dtype == HAL_F32) rms_norm_row<F32>(a, r);
    else if (a.dtype == HAL_F16) rms_norm_row<F16>(a, r);
    else rms_norm_row<BF16>(a, r);
}

int rms_norm(const hal_cpu_rms_norm_args *args) {
    const hal_cpu_rms_norm_args &a = *args;
    const int64_t per_task = std::max<int64_t>(1, a.rows_per_task);
    parallel_for((a.num_tokens + per_task - 1) / per_task, a.threads, [&](int64_t t) {
        const int64_t r1 = std::min(a.num_tokens, (t + 1) * per_task);
        for (int64_t r = t * per_task; r < r1; ++r) rms_norm_row(a, r);
    });
    return HAL_OK;
}
