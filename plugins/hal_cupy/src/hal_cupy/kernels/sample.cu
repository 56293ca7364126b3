// Token sampling: one token per row of logits (hal_core.ops.sample documents the semantics).
//
// One CTA per row.  Defines: HAL_DTYPE (of the logits), HAL_WARP_SIZE, optional HAL_NUM_THREADS (a power of
// two >= 64, default 256).  See README.md.
//
// No sort.  Passes over the row (coalesced, each thread a stride of the row): the maximum and a NaN check;
// greedy rows then one pass for the first maximum.  Otherwise the weights w = exp((x - max) / T) are
// recomputed in each pass from the logits: top-k by a radix select over the order-preserving keys of the
// float bits (four 8-bit histogram passes, integer counts); top-p by one pass for the kept mass and the same
// radix descent over histograms of mass (four passes); min-p from the maximum (weight 1); then one pass for
// each thread's kept mass over its own contiguous part of the row and a walk of one part.  Masses are summed as
// integers (w * 2**40, truncated: exact sums, so thresholds and the draw do not depend on the order threads
// add in, and every launch gives the same token); a weight below 2**-40 of the maximum's counts as 0.
//
// Parameter checks: a temperature that is negative or not finite, a top_p outside (0, 1] or a min_p outside
// [0, 1] gives that row -1 and is reported in error_flag (codes below, mapped back to argument names by
// hal_cupy._index_errors).
#include "hal_common.cuh"
#include "hal_index_checks.cuh"

#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 256
#endif

#define HAL_ERR_TEMPERATURE 16
#define HAL_ERR_TOP_P 32
#define HAL_ERR_MIN_P 64

namespace smp {

typedef unsigned long long u64;

// The unsigned key whose order is the float order (-0 and +0 one key; NaN never reaches it).
HAL_DEVICE unsigned order_key(float f) {
    unsigned b = hal_float_to_bits(f);
    if (b == 0x80000000u) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

HAL_DEVICE float key_value(unsigned k) { return hal_bits_to_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// The row's draw u in [0, 1): the top 53 bits of splitmix64(seed) over 2**53.
HAL_DEVICE double uniform_of_seed(hal_i64 seed) {
    u64 z = (u64)seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

HAL_DEVICE void add_u32(unsigned* p, unsigned v) {
#ifdef HAL_HOST
    *p += v;  // host threads are fibers that switch only at barriers and shuffles
#else
    atomicAdd(p, v);
#endif
}

HAL_DEVICE void add_u64(u64* p, u64 v) {
#ifdef HAL_HOST
    *p += v;
#else
    atomicAdd(p, v);
#endif
}

// Tree reductions over the CTA (deterministic; every thread gets the result).
HAL_DEVICE float block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    hal_barrier();
    for (int s = HAL_NUM_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = buf[threadIdx.x + s] > buf[threadIdx.x] ? buf[threadIdx.x + s]
                                                                                                : buf[threadIdx.x];
        hal_barrier();
    }
    const float r = buf[0];
    hal_barrier();
    return r;
}

HAL_DEVICE int block_min(int v, int* buf) {
    buf[threadIdx.x] = v;
    hal_barrier();
    for (int s = HAL_NUM_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && buf[threadIdx.x + s] < buf[threadIdx.x]) buf[threadIdx.x] = buf[threadIdx.x + s];
        hal_barrier();
    }
    const int r = buf[0];
    hal_barrier();
    return r;
}

HAL_DEVICE u64 block_sum(u64 v, u64* buf) {
    buf[threadIdx.x] = v;
    hal_barrier();
    for (int s = HAL_NUM_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        hal_barrier();
    }
    const u64 r = buf[0];
    hal_barrier();
    return r;
}

// A weight as an integer mass: w * 2**40, truncated (w <= 1).
HAL_DEVICE u64 mass_of(float w) { return (u64)(w * 1099511627776.0f); }

struct Row {
    float m, temperature;
    bool inf_max;  // the maximum is +inf: weight 1 on the +inf tokens, 0 elsewhere
};

// A logit's weight exp((v - max) / T), the temperature-scaled softmax before normalisation.
HAL_DEVICE float weight(const Row& r, float v) {
    if (r.inf_max) return v == r.m ? 1.0f : 0.0f;
    return expf((v - r.m) / r.temperature);
}

}  // namespace smp

HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_sample(const hal_t* HAL_RESTRICT logits, hal_i64 row_stride, int vocab, const float* HAL_RESTRICT temperature,
           const int* HAL_RESTRICT top_k, const float* HAL_RESTRICT top_p, const float* HAL_RESTRICT min_p,
           const hal_i64* HAL_RESTRICT seeds, hal_i64* HAL_RESTRICT out, int* HAL_RESTRICT error_flag) {
    __shared__ float red_f[HAL_NUM_THREADS];
    __shared__ int red_i[HAL_NUM_THREADS];
    __shared__ smp::u64 red_u[HAL_NUM_THREADS];
    __shared__ unsigned hist_n[256];
    __shared__ smp::u64 hist_m[256];
    __shared__ unsigned s_prefix;
    __shared__ smp::u64 s_need;
    __shared__ smp::u64 s_total;
    const int tid = (int)threadIdx.x;
    const hal_i64 row = blockIdx.x;
    const hal_t* x = logits + row * row_stride;
    const float inf = hal_bits_to_float(0x7f800000u);
    const float t_row = temperature[row];
    const float p = top_p ? top_p[row] : 1.0f;
    const float mp = min_p ? min_p[row] : 0.0f;
    const int k = top_k ? top_k[row] : 0;
    const int bad = (t_row >= 0.0f && t_row < inf ? 0 : HAL_ERR_TEMPERATURE) | (p > 0.0f && p <= 1.0f ? 0 : HAL_ERR_TOP_P) |
                    (mp >= 0.0f && mp <= 1.0f ? 0 : HAL_ERR_MIN_P);
    if (bad) {  // the same for every thread: the CTA leaves together
        if (tid == 0) {
            hal_report_index_error(error_flag, bad);
            out[row] = -1;
        }
        return;
    }

    // The maximum, and whether the row holds NaN.
    float m = -inf;
    int nan = 0;
    for (int i = tid; i < vocab; i += HAL_NUM_THREADS) {
        const float v = hal_to_float(x[i]);
        nan |= v != v;
        m = v > m ? v : m;
    }
    m = smp::block_max(m, red_f);
    nan = -smp::block_min(-nan, red_i);
    if (nan || m == -inf) {
        if (tid == 0) out[row] = -1;
        return;
    }
    if (t_row == 0.0f) {  // greedy: the first index of the maximum
        int first = 0x7fffffff;
        for (int i = tid; i < vocab; i += HAL_NUM_THREADS)
            if (hal_to_float(x[i]) == m) {
                first = i;
                break;
            }
        first = smp::block_min(first, red_i);
        if (tid == 0) out[row] = first;
        return;
    }
    const smp::Row r{m, t_row, m == inf};

    // top-k: the k-th largest logit, by a radix select over the keys (four 8-bit passes).
    float t = -inf;
    if (k > 0 && k < vocab) {
        if (tid == 0) {
            s_prefix = 0u;
            s_need = (smp::u64)k;
        }
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += HAL_NUM_THREADS) hist_n[b] = 0u;
            hal_barrier();
            const unsigned prefix = s_prefix;
            const unsigned high = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
            for (int i = tid; i < vocab; i += HAL_NUM_THREADS) {
                const unsigned key = smp::order_key(hal_to_float(x[i]));
                if ((key & high) == prefix) smp::add_u32(&hist_n[(key >> shift) & 255u], 1u);
            }
            hal_barrier();
            if (tid == 0) {
                smp::u64 need = s_need;
                int b = 255;
                for (; b > 0; --b) {
                    if (hist_n[b] >= need) break;
                    need -= hist_n[b];
                }
                s_need = need;
                s_prefix = prefix | ((unsigned)b << shift);
            }
            hal_barrier();
        }
        t = smp::key_value(s_prefix);
    }

    // top-p: the smallest logit whose kept mass strictly above it is below top_p times the kept mass.
    if (p < 1.0f) {
        smp::u64 mine = 0;
        for (int i = tid; i < vocab; i += HAL_NUM_THREADS) {
            const float v = hal_to_float(x[i]);
            if (v >= t) mine += smp::mass_of(smp::weight(r, v));
        }
        const double limit = (double)p * (double)smp::block_sum(mine, red_u);
        if (tid == 0) {
            s_prefix = 0u;
            s_need = 0u;  // here: the kept mass above the current prefix's range
        }
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += HAL_NUM_THREADS) {
                hist_n[b] = 0u;
                hist_m[b] = 0u;
            }
            hal_barrier();
            const unsigned prefix = s_prefix;
            const unsigned high = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
            for (int i = tid; i < vocab; i += HAL_NUM_THREADS) {
                const float v = hal_to_float(x[i]);
                if (!(v >= t)) continue;
                const unsigned key = smp::order_key(v);
                if ((key & high) != prefix) continue;
                const unsigned b = (key >> shift) & 255u;
                smp::add_u32(&hist_n[b], 1u);
                smp::add_u64(&hist_m[b], smp::mass_of(smp::weight(r, v)));
            }
            hal_barrier();
            if (tid == 0) {
                smp::u64 c = s_need, c_best = s_need;
                int best = -1;
                for (int b = 255; b >= 0; --b) {
                    if (!hist_n[b]) continue;
                    if (!((double)c < limit)) break;
                    best = b;
                    c_best = c;
                    c += hist_m[b];
                }
                if (best < 0) best = 255;  // unreachable: the highest candidate has no mass above it
                s_need = c_best;
                s_prefix = prefix | ((unsigned)best << shift);
            }
            hal_barrier();
        }
        t = smp::key_value(s_prefix);
    }

    // The draw: each thread's kept mass over its contiguous part, an exclusive scan, then one part walked.
    const int part = (vocab + HAL_NUM_THREADS - 1) / HAL_NUM_THREADS;
    const int lo = tid * part < vocab ? tid * part : vocab;
    const int hi = lo + part < vocab ? lo + part : vocab;
    smp::u64 mine = 0;
    for (int i = lo; i < hi; ++i) {
        const float v = hal_to_float(x[i]);
        if (!(v >= t)) continue;
        const float w = smp::weight(r, v);
        if (w >= mp) mine += smp::mass_of(w);
    }
    red_u[tid] = mine;
    hal_barrier();
    if (tid == 0) {
        smp::u64 run = 0;
        for (int j = 0; j < HAL_NUM_THREADS; ++j) {
            const smp::u64 s = red_u[j];
            red_u[j] = run;
            run += s;
        }
        s_total = run;
    }
    hal_barrier();
    const smp::u64 total = s_total;
    smp::u64 target = (smp::u64)(smp::uniform_of_seed(seeds[row]) * (double)total);
    if (target >= total) target = total - 1;  // rounding of u * total at the end (total > 0: the maximum has 2**40)
    smp::u64 cum = red_u[tid];
    if (cum <= target && target < cum + mine) {
        for (int i = lo; i < hi; ++i) {
            const float v = hal_to_float(x[i]);
            if (!(v >= t)) continue;
            const float w = smp::weight(r, v);
            if (!(w >= mp)) continue;
            cum += smp::mass_of(w);
            if (cum > target) {
                out[row] = i;
                break;
            }
        }
    }
}
