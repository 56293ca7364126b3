// sample.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// sample: one token per row (hal_core.ops.sample documents the semantics). Rows run in parallel; a row
// is walked in float32 without sorting: its maximum (SIMD), the top-k threshold by a radix select over
// the order-preserving keys of the float bits (four 8-bit histogram passes), the weights
// exp((x - max) / T) (SIMD, stored once), the top-p threshold by the same radix descent over histograms
// of mass, min-p from the maximum (weight 1), the kept mass (SIMD, per chunk) and the inverse-CDF walk in
// index order. Workspace: one row of float32 weights per task (plus one row of float32 logits for
// fp16/bf16 rows); a greedy row none (its chunks go through a 16 KiB stack buffer).
// ---------------------------------------------------------------------------------------------

namespace sampling {

constexpr int64_t kChunk = 4096;  // the walk's unit: chunk sums by SIMD, then one chunk element by element

// The unsigned key whose order is the float order (-0 and +0 one key; NaN never reaches here).
inline uint32_t order_key(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    if (b == 0x80000000u) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

inline float key_value(uint32_t k) {
    const uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

// The row's draw u in [0, 1): the top 53 bits of splitmix64(seed) over 2**53.
inline double uniform_of_seed(int64_t seed) {
    uint64_t z = uint64_t(seed) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return double(z >> 11) * (1.0 / 9007199254740992.0);
}

// The row's maximum and whether it holds NaN.
inline float row_max(const float *x, int64_t n, bool &nan) {
    V::f acc = V::set1(-kInf);
    int64_t i = 0;
    for (; i + W <= n; i += W) acc = vmax(acc, V::load(x + i));
    float m = hmax(acc);
    bool bad = false;
    for (int64_t j = 0; j < n; ++j) bad |= x[j] != x[j];  // a compare the compiler vectorises
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    nan = bad;
    return m;
}

// The largest key k with at least `need` keys >= k: the k-th largest logit (radix select, four passes).
inline float kth_largest(const float *x, int64_t n, int64_t need) {
    uint32_t prefix = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t count[256] = {0};
        const uint32_t high = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t key = order_key(x[i]);
            if ((key & high) == prefix) ++count[(key >> shift) & 255u];
        }
        int b = 255;
        for (; b > 0; --b) {
            if (count[b] >= need) break;
            need -= count[b];
        }
        prefix |= uint32_t(b) << shift;
    }
    return key_value(prefix);
}

// Sum of w over [a, b) where x >= t and w >= min_p (SIMD lanes, then the tail).
inline float kept_sum(const float *x, const float *w, int64_t a, int64_t b, float t, float min_p) {
    const V::f vt = V::set1(t), vm = V::set1(min_p), z = V::zero();
    V::f acc = z;
    int64_t i = a;
    for (; i + W <= b; i += W) {
        const V::f vw = V::load(w + i);
        acc = V::add(acc, V::select_le(vm, vw, V::select_le(vt, V::load(x + i), vw, z), z));
    }
    float s = V::hsum(acc);
    for (; i < b; ++i)
        if (x[i] >= t && w[i] >= min_p) s += w[i];
    return s;
}

inline double kept_mass(const float *x, const float *w, int64_t n, float t, float min_p) {
    double total = 0.0;
    for (int64_t a = 0; a < n; a += kChunk) total += kept_sum(x, w, a, std::min(n, a + kChunk), t, min_p);
    return total;
}

// The smallest logit value v (of a token >= t_k) whose tokens have kept mass strictly above v below
// limit: the top-p threshold, by a radix descent over mass histograms (four passes).
inline float top_p_threshold(const float *x, const float *w, int64_t n, float t_k, double limit) {
    uint32_t prefix = 0;
    double above = 0.0;  // mass of the candidates above the current prefix's range
    for (int shift = 24; shift >= 0; shift -= 8) {
        double mass[256] = {0.0};
        int64_t count[256] = {0};
        const uint32_t high = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int64_t i = 0; i < n; ++i) {
            if (!(x[i] >= t_k)) continue;
            const uint32_t key = order_key(x[i]);
            if ((key & high) != prefix) continue;
            const uint32_t b = (key >> shift) & 255u;
            mass[b] += w[i];
            ++count[b];
        }
        int best = -1;
        double c = above, c_best = above;
        for (int b = 255; b >= 0; --b) {
            if (!count[b]) continue;
            if (!(c < limit)) break;
            best = b;
            c_best = c;
            c += mass[b];
        }
        if (best < 0) return t_k;  // unreachable: the highest candidate always has mass above < limit
        prefix |= uint32_t(best) << shift;
        above = c_best;
    }
    return key_value(prefix);
}

// The first kept token whose running kept mass exceeds u times the kept mass (index order); -1: none.
inline int64_t walk(const float *x, const float *w, int64_t n, float t, float min_p, double u) {
    const double target = u * kept_mass(x, w, n, t, min_p);
    double before = 0.0;
    for (int64_t a = 0; a < n; a += kChunk) {
        const int64_t b = std::min(n, a + kChunk);
        const double chunk = kept_sum(x, w, a, b, t, min_p);
        if (before + chunk > target) {
            double cum = before;
            for (int64_t i = a; i < b; ++i) {
                if (!(x[i] >= t && w[i] >= min_p) || !(w[i] > 0.0f)) continue;
                cum += w[i];
                if (cum > target) return i;
            }
        }
        before += chunk;
    }
    for (int64_t i = n - 1; i >= 0; --i)  // rounding at the end of the CDF: the last kept token
        if (x[i] >= t && w[i] >= min_p && w[i] > 0.0f) return i;
    return -1;
}

struct Row {
    float temperature, top_p, min_p;
    int64_t top_k;
    int64_t seed;
};

// A greedy row of any dtype (row_ptr's): the first index of its maximum, -1 for a row holding NaN or only -inf.
// Chunk by chunk (fp16/bf16 converted into a stack buffer, float32 read in place): each chunk's maximum and NaN
// test (SIMD), then its first index only where the maximum grows, so the earliest of equal maxima is kept.
inline int64_t greedy_row(const void *row, int32_t dtype, int64_t n) {
    alignas(64) float buf[kChunk];
    float best = -kInf;
    int64_t at = -1;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t len = std::min(kChunk, n - c0);
        const float *x = static_cast<const float *>(row) + c0;
        if (dtype != HAL_F32) {
            any_row_to_f32(static_cast<const uint16_t *>(row) + c0, dtype, len, buf);
            x = buf;
        }
        bool nan = false;
        const float m = row_max(x, len, nan);
        if (nan) return -1;
        if (m > best) {
            best = m;
            int64_t i = 0;
            while (x[i] != m) ++i;
            at = c0 + i;
        }
    }
    return at;
}

// One row of float32 logits x (weights scratch w, n floats), temperature > 0; returns the token or -1.
inline int64_t sample_row(const float *x, float *w, int64_t n, const Row &r) {
    bool nan = false;
    const float m = row_max(x, n, nan);
    if (nan || m == -kInf) return -1;
    if (m == kInf) {
        for (int64_t i = 0; i < n; ++i) w[i] = x[i] == kInf ? 1.0f : 0.0f;
    } else {
        const V::f vm = V::set1(m), vt = V::set1(r.temperature);
        int64_t i = 0;
        for (; i + W <= n; i += W) V::store(w + i, V::exp(V::div(V::sub(V::load(x + i), vm), vt)));
        for (; i < n; ++i) w[i] = std::exp((x[i] - m) / r.temperature);
    }
    float t = -kInf;
    if (r.top_k > 0 && r.top_k < n) t = kth_largest(x, n, r.top_k);
    if (r.top_p < 1.0f) {
        const double mass = kept_mass(x, w, n, t, 0.0f);
        t = top_p_threshold(x, w, n, t, double(r.top_p) * mass);
    }
    return walk(x, w, n, t, r.min_p, uniform_of_seed(r.seed));
}

}  // namespace sampling

int sample(const hal_cpu_sample_args *args) {
    const hal_cpu_sample_args &a = *args;
    const int64_t n = a.vocab_size;
    std::atomic<int> status{HAL_OK};
    parallel_for(a.num_seqs, a.threads, [&](int64_t s) {
        const sampling::Row r{a.temperature[s], a.top_p ? a.top_p[s] : 1.0f, a.min_p ? a.min_p[s] : 0.0f,
                              a.top_k ? int64_t(a.top_k[s]) : 0, a.seeds[s]};
        const void *row = row_ptr(a.logits, a.dtype, s, a.logits_stride);
        if (r.temperature == 0.0f) {
            a.out[s] = sampling::greedy_row(row, a.dtype, n);
            return;
        }
        const bool convert = a.dtype != HAL_F32;
        std::unique_ptr<float[]> scratch(new (std::nothrow) float[size_t(n) * (convert ? 2 : 1)]);
        if (!scratch) {
            status.store(HAL_ENOMEM, std::memory_order_relaxed);
            return;
        }
        const float *x = static_cast<const float *>(row);
        if (convert) {
            any_row_to_f32(row, a.dtype, n, scratch.get());
            x = scratch.get();
        }
        a.out[s] = sampling::sample_row(x, scratch.get() + (convert ? n : 0), n, r);
    });
    return status.load();
}
