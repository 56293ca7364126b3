// paged_attention.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// paged_attention, variable length: the new tokens of a batch mixing prompts, prompt chunks and
// decoding sequences (hal_cpu_attention_args), causal aligned bottom-right, with an optional
// sliding window, logit softcap, sinks and ALiBi. One kernel, two kinds of task:
//
// - rows of a sequence with one new token (decode) are bandwidth-bound: a task covers one sequence
//   (or one partition of its keys, split-KV) and every KV head, walking its blocks in order and,
//   inside a block, its KV heads, so each block's K (and V) rows of all heads are one contiguous
//   run the hardware prefetcher streams; per head, register tiles of (keys x query heads) dot
//   products, an online softmax and register tiles of (query heads x columns) for P @ V.
// - sequences with several new tokens (prefill, prompt chunks) are compute-bound: a task owns one
//   KV head and a tile of query tokens, whose rows (token x GQA head) share every K/V tile it reads.
//   Per tile of keys, K and V are widened once into float32 rows, S^T = K Q^T runs in register
//   tiles with the query rows in the vector lanes, so the online softmax is lane-wise (no
//   horizontal reduction) and P^T is already the layout P @ V broadcasts from; tiles the causal
//   mask or the window hide entirely are never visited. bf16 and fp16 run both products on AMX
//   tiles where the CPU and the OS allow it (attention_amx.inl).
//
// The kernel is split by job: attention_shared.inl (the context, score transform, normalisation and
// output store both kinds of task use), attention_decode.inl (decode tasks and the split-KV merge),
// attention_prefill.inl (prefill tasks), attention_amx.inl (prefill on AMX tiles, AVX-512 variants);
// this file plans the tasks and is the entry point.
// ---------------------------------------------------------------------------------------------

#include "attention_shared.inl"
#include "attention_decode.inl"
#include "attention_prefill.inl"

#if defined(HAL_ISA_AVX512)
#include "attention_amx.inl"
#else
inline bool attention_amx() { return false; }
#endif

inline int attention_amx_enabled() { return attention_amx() ? 1 : 0; }

// ---------------------------------------------------------------------------------------------
// Planning: tasks of both kinds in one parallel pass, costliest first; then the split decode rows' merges.
// ---------------------------------------------------------------------------------------------
template <class S>
int paged_attention_t(const AttnCtx &c) {
    const hal_cpu_attention_args &a = *c.a;
    struct Task { int32_t s, kvh; int64_t t0, t1; int64_t part; double cost; };  // kvh < 0: decode
    std::vector<Task> tasks;
    std::vector<int64_t> first_part(size_t(a.num_seqs), -1);
    std::vector<int32_t> nparts(size_t(a.num_seqs), 0);
    int64_t parts_total = 0;
    const int64_t tile_cap = a.max_query_len > 0 ? a.max_query_len : INT32_MAX;
    std::vector<float> zeros(size_t(a.head_size), 0.0f);
    for (int s = 0; s < a.num_seqs; ++s) {
        const int64_t len = a.seq_lens[s];
        const int n = c.q_len(s);
        if (n <= 0) continue;
        if (n == 1) {
            if (len <= 0) {  // decode of an empty sequence: zeros
                for (int h = 0; h < a.num_heads; ++h) store_row(zeros.data(), a.head_size, out_row(a, c.row0(s), h), a.out_dtype);
                continue;
            }
            const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
            const int64_t ptok = a.partition_tokens > 0 ? a.partition_tokens : len - lo;
            const int np = int((len - lo + ptok - 1) / ptok);
            nparts[s] = np;
            if (np > 1) first_part[s] = parts_total;
            for (int p = 0; p < np; ++p) {
                const int64_t t0 = lo + p * ptok, t1 = std::min(len, t0 + ptok);
                tasks.push_back({s, -1, t0, t1, np > 1 ? parts_total + p : -1, double(t1 - t0) * a.num_heads});
            }
            if (np > 1) parts_total += np;
            continue;
        }
        const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(a.query_tile > 0 ? a.query_tile : n, tile_cap));
        for (int64_t i0 = 0; i0 < n; i0 += tile) {
            const int64_t i1 = std::min<int64_t>(n, i0 + tile), p_hi = len - n + i1 - 1;
            const int64_t k0 = a.window > 0 ? std::max<int64_t>(0, len - n + i0 - a.window + 1) : 0;
            const double cost = double(i1 - i0) * c.gq * double(p_hi + 1 - k0);
            for (int kvh = 0; kvh < a.num_kv_heads; ++kvh) tasks.push_back({s, kvh, i0, i1, -1, cost});
        }
    }
    const int64_t pstride = int64_t(a.num_heads) * (a.head_size + 2);
    std::vector<float> parts(size_t(parts_total) * pstride);
    // Costliest tasks first: dynamic scheduling then balances the ragged tail.
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task &x, const Task &y) { return x.cost > y.cost; });
    parallel_for(int64_t(tasks.size()), a.threads, [&](int64_t i) {
        const Task &t = tasks[i];
        if (t.kvh < 0) decode_task<S>(c, t.s, t.t0, t.t1, t.part >= 0 ? parts.data() + t.part * pstride : nullptr);
#if defined(HAL_ISA_AVX512)
        else if (c.amx) prefill_task_amx<S>(c, t.s, t.kvh, int(t.t0), int(t.t1));
#endif
        else prefill_task<S>(c, t.s, t.kvh, int(t.t0), int(t.t1));
    });
    if (parts_total) {
        parallel_for(int64_t(a.num_seqs) * a.num_kv_heads, a.threads, [&](int64_t i) {
            const int s = int(i / a.num_kv_heads);
            if (first_part[s] >= 0)
                decode_merge(c, s, int(i % a.num_kv_heads), parts.data() + first_part[s] * pstride, nparts[s]);
        });
    }
    return HAL_OK;
}

int paged_attention(const hal_cpu_attention_args *args) {
    const hal_cpu_attention_args &a = *args;
    AttnCtx c{args, a.num_heads / a.num_kv_heads, a.dtype == HAL_BF16 && a.head_size % 32 == 0 && cpu_has_bf16_dot(),
              a.dtype != HAL_F32 && attention_amx()};
    try {
        if (a.dtype == HAL_F16) return paged_attention_t<F16>(c);
        if (a.dtype == HAL_BF16) return paged_attention_t<BF16>(c);
        return paged_attention_t<F32>(c);
    } catch (const std::bad_alloc &) {
        return HAL_ENOMEM;
    }
}
