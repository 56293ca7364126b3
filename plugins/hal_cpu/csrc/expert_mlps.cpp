// expert_mlps.cpp: fused_moe's experts of few rows in one call (hal_cpu_expert_mlps, csrc/hal_cpu_kernels.h),
// and a whole such call from its routing (hal_cpu_moe_experts: grouping, gathering, the experts, the combine).
//
// Each job is one expert's w13 GEMM, gated activation and w2 GEMM, run through the library's own entry points
// (the selected variant's kernels) with threads = 1, so on the thread that took the job; the jobs are spread
// over the threads by one parallel job. Compiled for the base instruction set, like dispatch.cpp.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "common.h"
#include "hal_cpu_kernels.h"

namespace {

// The kind's GEMM at base[j], on this thread alone.
template <class Args>
int expert_gemm(int (*kernel)(const Args *), const void *base, int64_t j) {
    Args args = static_cast<const Args *>(base)[j];
    args.threads = 1;
    return kernel(&args);
}

}  // namespace

extern "C" int hal_cpu_expert_mlps(const hal_cpu_expert_mlps_args *args) {
    const hal_cpu_expert_mlps_args &a = *args;
    std::atomic<int> rc{HAL_OK};
    auto gemm = [&](const void *base, int64_t j) {
        if (a.kind == HAL_EXPERT_W4A16) return expert_gemm(hal_cpu_w4a16_gemv, base, j);
        if (a.kind == HAL_EXPERT_W8A8) return expert_gemm(hal_cpu_w8a8_gemm, base, j);
        return expert_gemm(hal_cpu_w4a8_gemm, base, j);
    };
    hal::parallel_for(a.jobs, a.threads, [&](int64_t j) {
        int r = gemm(a.up, j);
        if (r == HAL_OK) {
            hal_cpu_gated_activation_args act = a.act[j];
            act.threads = 1;
            r = hal_cpu_gated_activation(&act);
        }
        if (r == HAL_OK) r = gemm(a.down, j);
        if (r != HAL_OK) rc = r;
    });
    return rc.load();
}

namespace {

// Each hit expert's rows, in increasing expert order: the expert, its first row in the gathered buffers, its
// row count, and for each (token, slot) pair its row.
struct Groups {
    std::vector<int64_t> experts, starts, counts, row_of_pair;
};

// The pairs grouped by expert (token order kept within each, as a stable sort of the ids); false on an id out
// of range.
bool group(const hal_cpu_moe_experts_args &a, Groups &g) {
    std::vector<int64_t> count(a.num_experts, 0), next(a.num_experts, 0);
    for (int64_t t = 0; t < a.tokens; ++t) {
        for (int64_t s = 0; s < a.top_k; ++s) {
            int64_t e = a.ids[t * a.ids_stride + s];
            if (e < 0 || e >= a.num_experts) return false;
            ++count[e];
        }
    }
    int64_t row = 0;
    for (int64_t e = 0; e < a.num_experts; ++e) {
        if (!count[e]) continue;
        g.experts.push_back(e);
        g.starts.push_back(row);
        g.counts.push_back(count[e]);
        next[e] = row;
        row += count[e];
    }
    g.row_of_pair.resize(a.tokens * a.top_k);
    for (int64_t t = 0; t < a.tokens; ++t)
        for (int64_t s = 0; s < a.top_k; ++s) g.row_of_pair[t * a.top_k + s] = next[a.ids[t * a.ids_stride + s]]++;
    return true;
}

// Every hit expert's GEMM structs from the tables, with their rows' addresses, run by hal_cpu_expert_mlps.
template <class Args>
int run_experts(const hal_cpu_moe_experts_args &a, const Groups &g, const char *xs, int64_t x_row, float *h,
                float *act, float *y) {
    const int64_t jobs = static_cast<int64_t>(g.experts.size()), inter = a.intermediate_size;
    std::vector<Args> up(jobs), down(jobs);
    std::vector<hal_cpu_gated_activation_args> acts(jobs);
    for (int64_t j = 0; j < jobs; ++j) {
        const int64_t e = g.experts[j], start = g.starts[j], n = g.counts[j];
        up[j] = static_cast<const Args *>(a.up[n - 1])[e];
        down[j] = static_cast<const Args *>(a.down[n - 1])[e];
        up[j].x = xs + start * x_row;
        up[j].y = h + start * 2 * inter;
        down[j].x = act + start * inter;
        down[j].y = y + start * a.hidden;
        hal_cpu_gated_activation_args &f = acts[j];
        f.gate = up[j].y;
        f.up = h + start * 2 * inter + inter;  // the second half of each row
        f.gate_stride = f.up_stride = 2 * inter;
        f.out = act + start * inter;
        f.out_stride = f.intermediate_size = inter;
        f.num_tokens = f.rows_per_task = n;
        f.activation = a.activation;
        f.dtype = HAL_F32;
        f.threads = 1;
    }
    hal_cpu_expert_mlps_args m{up.data(), acts.data(), down.data(), jobs, a.kind, a.threads};
    return hal_cpu_expert_mlps(&m);
}

bool all_finite(const float *v, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(v[i])) return false;
    return true;
}

int moe_experts(const hal_cpu_moe_experts_args &a) {
    Groups g;
    if (!group(a, g)) return HAL_DECLINED;
    const int64_t jobs = static_cast<int64_t>(g.experts.size()), pairs = a.tokens * a.top_k;
    if (jobs == 0 || jobs < a.threads) return HAL_DECLINED;
    for (int64_t j = 0; j < jobs; ++j) {
        const int64_t n = g.counts[j];
        if (n > a.max_rows || !a.up[n - 1] || !a.down[n - 1] || !a.ready[n - 1] || !a.ready[n - 1][g.experts[j]])
            return HAL_DECLINED;
    }
    const int64_t x_row = a.hidden * a.x_itemsize, inter = a.intermediate_size;
    std::vector<char> xs(pairs * x_row);
    std::vector<float> h(pairs * 2 * inter), act(pairs * inter), y(pairs * a.hidden);
    const char *x = static_cast<const char *>(a.x);
    for (int64_t p = 0; p < pairs; ++p)
        std::memcpy(xs.data() + g.row_of_pair[p] * x_row, x + (p / a.top_k) * a.x_stride * a.x_itemsize, x_row);
    int rc = a.kind == HAL_EXPERT_W4A16 ? run_experts<hal_cpu_w4a16_gemv_args>(a, g, xs.data(), x_row, h.data(),
                                                                               act.data(), y.data())
             : a.kind == HAL_EXPERT_W8A8 ? run_experts<hal_cpu_w8a8_gemm_args>(a, g, xs.data(), x_row, h.data(),
                                                                               act.data(), y.data())
                                         : run_experts<hal_cpu_w4a8_gemm_args>(a, g, xs.data(), x_row, h.data(),
                                                                               act.data(), y.data());
    if (rc != HAL_OK) return rc;
    if (a.kind == HAL_EXPERT_W4A16 && !all_finite(y.data(), pairs * a.hidden)) return HAL_DECLINED;
    // out[t]: its experts in increasing order (a row's ids are distinct: sort its few slots by expert).
    std::vector<int64_t> slots(a.top_k);
    for (int64_t t = 0; t < a.tokens; ++t) {
        const int64_t *ids = a.ids + t * a.ids_stride;
        for (int64_t s = 0; s < a.top_k; ++s) slots[s] = s;
        std::sort(slots.begin(), slots.end(), [&](int64_t l, int64_t r) { return ids[l] < ids[r]; });
        float *o = a.out + t * a.hidden;
        std::fill(o, o + a.hidden, 0.0f);
        for (int64_t s : slots) {
            const float w = a.weights[t * a.weights_stride + s];
            const float *row = y.data() + g.row_of_pair[t * a.top_k + s] * a.hidden;
            for (int64_t i = 0; i < a.hidden; ++i) {
                const float product = row[i] * w;  // rounded, then added (no contraction in this unit)
                o[i] = o[i] + product;
            }
        }
    }
    return HAL_OK;
}

}  // namespace

extern "C" int hal_cpu_moe_experts(const hal_cpu_moe_experts_args *args) {
    try {
        return moe_experts(*args);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
