// rms_norm.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// RMSNorm with an optional fused residual add (hal-core's rms_norm contract)
// ---------------------------------------------------------------------------------------------
// Rows are cut into blocks of kNormBlock elements held in float32 on the stack. Per row: one pass reads x (and
// residual, writing the sum back in the dtype and re-reading the rounded block) and sums the squares in W lanes;
// a second pass, over data the first left in cache, scales by rsqrt(mean + epsilon) and the weight and writes out.
// The lane sums are added in a fixed order: every thread count gives the same bits.

constexpr int kNormBlock = 512;  // a multiple of every variant's W

// n (<= kNormBlock) elements of src in dtype to buf, the lanes up to the next multiple of W zeroed.
inline int load_block(const void *src, int32_t dtype, int n, float *buf) {
    any_row_to_f32(src, dtype, n, buf);
    const int padded = (n + W - 1) / W * W;
    for (int e = n; e < padded; ++e) buf[e] = 0.0f;
    return padded;
}

inline void *elem_ptr(void *base, int32_t dtype, int64_t offset) {
    return static_cast<char *>(base) + offset * (dtype == HAL_F32 ? 4 : 2);
}

inline void rms_norm_row(const hal_cpu_rms_norm_args &a, int64_t r) {
    alignas(64) float h[kNormBlock];
    alignas(64) float w[kNormBlock];
    const int64_t d = a.hidden_size;
    const void *x = row_ptr(a.x, a.dtype, r, a.x_stride);
    void *res = a.residual ? elem_ptr(a.residual, a.dtype, r * a.residual_stride) : nullptr;
    V::f ss = V::zero();
    for (int64_t c = 0; c < d; c += kNormBlock) {
        const int n = int(std::min<int64_t>(kNormBlock, d - c));
        int padded = load_block(row_ptr(x, a.dtype, c, 1), a.dtype, n, h);
        if (res) {
            void *rc = elem_ptr(res, a.dtype, c);
            load_block(rc, a.dtype, n, w);
            for (int e = 0; e < padded; e += W) V::store(h + e, V::add(V::load(h + e), V::load(w + e)));
            store_row(h, n, rc, a.dtype);
            if (a.dtype != HAL_F32) padded = load_block(rc, a.dtype, n, h);  // the sum as stored (rounded)
        }
        for (int e = 0; e < padded; e += W) {
            const V::f v = V::load(h + e);
            ss = V::fma(v, v, ss);
        }
    }
    const float scale = 1.0f / std::sqrt(V::hsum(ss) / float(d) + a.epsilon);
    const V::f vs = V::set1(scale), off = V::set1(a.weight_offset);
    const void *src = res ? static_cast<const void *>(res) : x;
    void *out = elem_ptr(a.out, a.dtype, r * a.out_stride);
    for (int64_t c = 0; c < d; c += kNormBlock) {
        const int n = int(std::min<int64_t>(kNormBlock, d - c));
        const int padded = load_block(row_ptr(src, a.dtype, c, 1), a.dtype, n, h);
        load_block(row_ptr(a.weight, a.dtype, c, 1), a.dtype, n, w);
        for (int e = 0; e < padded; e += W)
            V::store(h + e, V::mul(V::mul(V::load(h + e), vs), V::add(V::load(w + e), off)));
        store_row(h, n, elem_ptr(out, a.dtype, c), a.dtype);
    }
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
