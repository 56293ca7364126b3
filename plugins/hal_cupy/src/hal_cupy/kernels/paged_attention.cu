// Paged-attention decode kernels (one query token per sequence).
//
// Defines: HAL_DTYPE (0 f32, 1 f16, 2 bf16), HAL_HEAD_SIZE, HAL_GQA (query
// heads handled by one CTA; 1, 2, 4 or 8), optional HAL_NUM_THREADS (128) and
// HAL_UNROLL (4, tokens per thread per chunk).  See README.md for launch rules.
//
// Index checks (hal_index_checks.cuh): a CTA reads a sequence only when its
// length lies in [0, max_seq_len] and the block-table entries of the tokens
// it covers lie in [0, num_blocks); otherwise it reports seq_lens or
// block_tables in error_flag and the sequence's output is zeros (the split
// kernel marks its partition with exp_sum -1, which the reduce turns into
// zeros).
#include "hal_common.cuh"
#include "hal_index_checks.cuh"

#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 128
#endif
#ifndef HAL_UNROLL
#define HAL_UNROLL 4
#endif

namespace pa {

constexpr int HS = HAL_HEAD_SIZE;
constexpr int GQA = HAL_GQA;
constexpr int NT = HAL_NUM_THREADS;
constexpr int WARP = HAL_WARP_SIZE;
constexpr int NWARPS = NT / WARP;
constexpr int EPV = HAL_EPV;
constexpr int NVEC = HS / EPV;  // 16-byte vectors per K/V row

constexpr int NVEC_P2 = NVEC <= 1 ? 1 : NVEC <= 2 ? 2 : NVEC <= 4 ? 4 : NVEC <= 8 ? 8
                      : NVEC <= 16 ? 16 : NVEC <= 32 ? 32 : NVEC <= 64 ? 64 : 128;
// Lanes sharing one token row, vectors per lane, token slots per warp / CTA.
constexpr int LPT = NVEC_P2 < WARP ? NVEC_P2 : WARP;
constexpr int VPL = (NVEC + LPT - 1) / LPT;
constexpr int SPW = WARP / LPT;
constexpr int SLOTS = NWARPS * SPW;
constexpr int CHUNK = SLOTS * HAL_UNROLL;  // tokens per softmax step
constexpr int REG = VPL * EPV;             // floats per lane per row

static_assert(HS % EPV == 0, "head size must fill whole 16-byte vectors");
static_assert(NT % WARP == 0, "HAL_NUM_THREADS must be a multiple of the warp size");
static_assert(GQA >= 1 && GQA <= 8, "HAL_GQA must be in 1..8");

// Attention of query heads [head0, head0 + n_valid) of sequence s over tokens
// [t0, t1).  Leaves the unnormalised output in s_out and the running max and
// exp-sum per head in s_m / s_l (all in shared memory).
HAL_DEVICE void attend(const hal_t* HAL_RESTRICT query, const hal_t* HAL_RESTRICT key_cache,
                       const hal_t* HAL_RESTRICT value_cache, const int* HAL_RESTRICT block_table,
                       float scale, int s, int num_heads, int num_kv_heads, int kv_head, int head0,
                       int n_valid, int block_size, int t0, int t1, float (*s_logit)[CHUNK],
                       float* s_m, float* s_l, float* s_alpha, float (*s_out)[HS]) {
    const int tid = threadIdx.x;
    const int lane = tid % WARP;
    const int warp = tid / WARP;
    const int vec = lane % LPT;
    const int slot = warp * SPW + lane / LPT;

    // This lane's slice of the (pre-scaled) queries.
    float qf[GQA][REG];
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
            const int vi = vec + j * LPT;
            if (g < n_valid && vi < NVEC) {
                const hal_t* p = query + ((hal_i64)s * num_heads + head0 + g) * HS + vi * EPV;
                hal_unpack16(hal_load16(p), &qf[g][j * EPV]);
#pragma unroll
                for (int e = 0; e < EPV; ++e) qf[g][j * EPV + e] *= scale;
            } else {
#pragma unroll
                for (int e = 0; e < EPV; ++e) qf[g][j * EPV + e] = 0.f;
            }
        }
    }
    float acc[GQA][REG];
#pragma unroll
    for (int g = 0; g < GQA; ++g)
#pragma unroll
        for (int e = 0; e < REG; ++e) acc[g][e] = 0.f;

    if (tid < GQA) {
        s_m[tid] = HAL_NEG_INF;
        s_l[tid] = 0.f;
    }

    for (int c0 = t0; c0 < t1; c0 += CHUNK) {
        hal_i64 row[HAL_UNROLL];
        bool ok[HAL_UNROLL];
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u) {
            const int t = c0 + u * SLOTS + slot;
            ok[u] = t < t1;
            row[u] = 0;
            if (ok[u]) {
                const hal_i64 phys = block_table[t / block_size];
                row[u] = ((phys * num_kv_heads + kv_head) * block_size + t % block_size) * HS;
            }
        }
        hal_vec16 kv[HAL_UNROLL][VPL];
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const int vi = vec + j * LPT;
                kv[u][j] = ok[u] && vi < NVEC ? hal_load16(key_cache + row[u] + vi * EPV)
                                              : make_uint4(0u, 0u, 0u, 0u);
            }
        // Logits: partial dot products, then a sum over the LPT lanes of a row.
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u) {
            float kf[REG];
#pragma unroll
            for (int j = 0; j < VPL; ++j) hal_unpack16(kv[u][j], &kf[j * EPV]);
#pragma unroll
            for (int g = 0; g < GQA; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < REG; ++e) dot += qf[g][e] * kf[e];
#pragma unroll
                for (int m = LPT / 2; m > 0; m >>= 1) dot += hal_shfl_xor(dot, m);
                if (vec == 0) s_logit[g][u * SLOTS + slot] = ok[u] ? dot : HAL_NEG_INF;
            }
        }
        // Issue the V loads before the softmax step so they overlap it.
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const int vi = vec + j * LPT;
                kv[u][j] = ok[u] && vi < NVEC ? hal_load16(value_cache + row[u] + vi * EPV)
                                              : make_uint4(0u, 0u, 0u, 0u);
            }
        hal_barrier();

        // Online softmax update, one warp per head.
        for (int g = warp; g < GQA; g += NWARPS) {
            float mx = HAL_NEG_INF;
            for (int i = lane; i < CHUNK; i += WARP) mx = fmaxf(mx, s_logit[g][i]);
            mx = hal_warp_max(mx);
            const float m_old = s_m[g];
            const float m_new = fmaxf(m_old, mx);  // finite: each chunk has a valid token
            float sum = 0.f;
            for (int i = lane; i < CHUNK; i += WARP) {
                const float p = expf(s_logit[g][i] - m_new);
                s_logit[g][i] = p;
                sum += p;
            }
            sum = hal_warp_sum(sum);
            if (lane == 0) {
                const float alpha = expf(m_old - m_new);
                s_alpha[g] = alpha;
                s_l[g] = s_l[g] * alpha + sum;
                s_m[g] = m_new;
            }
        }
        hal_barrier();

#pragma unroll
        for (int g = 0; g < GQA; ++g) {
            const float a = s_alpha[g];
#pragma unroll
            for (int e = 0; e < REG; ++e) acc[g][e] *= a;
        }
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u) {
            float vf[REG];
#pragma unroll
            for (int j = 0; j < VPL; ++j) hal_unpack16(kv[u][j], &vf[j * EPV]);
#pragma unroll
            for (int g = 0; g < GQA; ++g) {
                const float p = s_logit[g][u * SLOTS + slot];
#pragma unroll
                for (int e = 0; e < REG; ++e) acc[g][e] += p * vf[e];
            }
        }
        hal_barrier();
    }

    // Sum the token slots: first inside each warp, then across warps.
#pragma unroll
    for (int g = 0; g < GQA; ++g)
#pragma unroll
        for (int e = 0; e < REG; ++e)
#pragma unroll
            for (int m = LPT; m < WARP; m <<= 1) acc[g][e] += hal_shfl_xor(acc[g][e], m);
    for (int w = 0; w < NWARPS; ++w) {
        if (warp == w && lane < LPT) {
#pragma unroll
            for (int g = 0; g < GQA; ++g)
#pragma unroll
                for (int j = 0; j < VPL; ++j) {
                    const int vi = vec + j * LPT;
                    if (vi < NVEC) {
#pragma unroll
                        for (int e = 0; e < EPV; ++e) {
                            float& o = s_out[g][vi * EPV + e];
                            o = (w == 0 ? 0.f : o) + acc[g][j * EPV + e];
                        }
                    }
                }
        }
        hal_barrier();
    }
}

// Maps blockIdx.x to (kv head, first query head, number of valid heads).
HAL_DEVICE void head_tile(int num_heads, int num_kv_heads, int* kv_head, int* head0, int* n_valid) {
    const int group = num_heads / num_kv_heads;
    const int tiles = (group + GQA - 1) / GQA;
    const int tile = blockIdx.x % tiles;
    *kv_head = blockIdx.x / tiles;
    *head0 = *kv_head * group + tile * GQA;
    const int left = group - tile * GQA;
    *n_valid = left < GQA ? left : GQA;
}

// 0 when tokens [t0, t1) of a sequence of length seq_len may be read: the length in [0, max_seq_len] (and
// within the table's row) and the table entries of those tokens in [0, num_blocks).  Else the error code,
// reported by thread 0.  Cooperative (hal_block_table_ok): every thread of the CTA calls it.
HAL_DEVICE int check_indices(const int* HAL_RESTRICT table, int seq_len, int t0, int t1, int block_size,
                             int max_blocks_per_seq, int num_blocks, int max_seq_len, int* error_flag) {
    const int capacity = max_blocks_per_seq * block_size;
    const int limit = max_seq_len < capacity ? max_seq_len : capacity;
    int code = 0;
    if (seq_len < 0 || seq_len > limit)
        code = HAL_ERR_SEQ_LENS;
    else if (t1 > t0 && !hal_block_table_ok(table, t0 / block_size, (t1 - 1) / block_size + 1, num_blocks, NT))
        code = HAL_ERR_BLOCK_TABLES;
    if (code != 0 && threadIdx.x == 0) hal_report_index_error(error_flag, code);
    return code;
}

// Marks partition p of query heads [head0, head0 + n_valid) of sequence s as unusable (exp_sum -1: the
// reduce step writes zeros for the sequence).
HAL_DEVICE void mark_partition(float* HAL_RESTRICT max_logits, float* HAL_RESTRICT exp_sums, int s, int p,
                               int num_heads, int head0, int n_valid, int max_partitions) {
    for (int g = threadIdx.x; g < n_valid; g += NT) {
        const hal_i64 sp = ((hal_i64)s * num_heads + head0 + g) * max_partitions + p;
        max_logits[sp] = 0.f;
        exp_sums[sp] = -1.f;
    }
}

}  // namespace pa

// Single pass: one CTA covers the whole sequence and writes the final output.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention(hal_t* HAL_RESTRICT out, const hal_t* HAL_RESTRICT query,
                    const hal_t* HAL_RESTRICT key_cache, const hal_t* HAL_RESTRICT value_cache,
                    const int* HAL_RESTRICT block_tables, const int* HAL_RESTRICT seq_lens,
                    float scale, int num_heads, int num_kv_heads, int block_size,
                    int max_blocks_per_seq, int num_blocks, int max_seq_len, int* HAL_RESTRICT error_flag) {
    using namespace pa;
    __shared__ float s_logit[GQA][CHUNK];
    __shared__ float s_out[GQA][HS];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    const int s = blockIdx.y;
    int kv_head, head0, n_valid;
    head_tile(num_heads, num_kv_heads, &kv_head, &head0, &n_valid);
    const int seq_len = seq_lens[s];
    const int* table = block_tables + (hal_i64)s * max_blocks_per_seq;
    if (check_indices(table, seq_len, 0, seq_len, block_size, max_blocks_per_seq, num_blocks, max_seq_len,
                      error_flag) != 0) {
        for (int i = threadIdx.x; i < n_valid * HS; i += NT)
            out[((hal_i64)s * num_heads + head0 + i / HS) * HS + i % HS] = hal_from_float(0.f);
        return;
    }
    attend(query, key_cache, value_cache, table, scale,
           s, num_heads, num_kv_heads, kv_head, head0, n_valid, block_size, 0, seq_len, s_logit,
           s_m, s_l, s_alpha, s_out);
    for (int i = threadIdx.x; i < n_valid * HS; i += NT) {
        const int g = i / HS, d = i % HS;
        // l >= 1 for finite logits; NaN when a NaN/inf logit made the softmax NaN (kept, as the reference does)
        const float v = seq_len > 0 ? s_out[g][d] / s_l[g] : 0.f;
        out[((hal_i64)s * num_heads + head0 + g) * HS + d] = hal_from_float(v);
    }
}

// Split-KV: CTA (x, s, p) covers tokens [p * partition_size, (p + 1) * partition_size)
// and writes unnormalised fp32 partial outputs plus max logit and exp-sum.
// Partitions starting at or beyond seq_lens[s] write nothing; one whose indices fail the checks (every one,
// for a bad length) is marked with exp_sum -1 instead.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention_split(float* HAL_RESTRICT tmp_out, float* HAL_RESTRICT max_logits,
                          float* HAL_RESTRICT exp_sums, const hal_t* HAL_RESTRICT query,
                          const hal_t* HAL_RESTRICT key_cache, const hal_t* HAL_RESTRICT value_cache,
                          const int* HAL_RESTRICT block_tables, const int* HAL_RESTRICT seq_lens,
                          float scale, int num_heads, int num_kv_heads, int block_size,
                          int max_blocks_per_seq, int partition_size, int max_partitions, int num_blocks,
                          int max_seq_len, int* HAL_RESTRICT error_flag) {
    using namespace pa;
    __shared__ float s_logit[GQA][CHUNK];
    __shared__ float s_out[GQA][HS];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    const int s = blockIdx.y;
    const int p = blockIdx.z;
    const int seq_len = seq_lens[s];
    const int t0 = p * partition_size;
    int kv_head, head0, n_valid;
    head_tile(num_heads, num_kv_heads, &kv_head, &head0, &n_valid);
    const int* table = block_tables + (hal_i64)s * max_blocks_per_seq;
    const int t1 = t0 >= seq_len ? t0 : seq_len - t0 < partition_size ? seq_len : t0 + partition_size;
    if (check_indices(table, seq_len, t0, t1, block_size, max_blocks_per_seq, num_blocks, max_seq_len,
                      error_flag) != 0) {
        mark_partition(max_logits, exp_sums, s, p, num_heads, head0, n_valid, max_partitions);
        return;
    }
    if (t0 >= seq_len) return;
    attend(query, key_cache, value_cache, table, scale,
           s, num_heads, num_kv_heads, kv_head, head0, n_valid, block_size, t0, t1, s_logit,
           s_m, s_l, s_alpha, s_out);
    for (int i = threadIdx.x; i < n_valid * HS; i += NT) {
        const int g = i / HS, d = i % HS;
        const hal_i64 sp = ((hal_i64)s * num_heads + head0 + g) * max_partitions + p;
        tmp_out[sp * HS + d] = s_out[g][d];
        if (d == 0) {
            max_logits[sp] = s_m[g];
            exp_sums[sp] = s_l[g];
        }
    }
}

// Merges the partitions of hal_paged_attention_split (or hal_paged_attention_tc) with log-sum-exp.
// Grid (num_heads, num_seqs, slices), HAL_NUM_THREADS threads: CTA (h, s, z) writes columns
// [z * HS / slices, (z + 1) * HS / slices) of head h of sequence s (slices divides HS; more slices fill a
// device that has more compute units than heads x sequences).  The partitions' weights exp(m_p - max) are
// computed once per CTA into shared memory, RP at a time; when a slice is narrower than the CTA, the threads
// split the partitions into lanes and add the lanes' sums in a fixed order at the end.
// A partition marked by the index checks (exp_sum < 0; a real exp-sum is >= 0 or NaN) makes the output zeros.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention_reduce(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT tmp_out,
                           const float* HAL_RESTRICT max_logits, const float* HAL_RESTRICT exp_sums,
                           const int* HAL_RESTRICT seq_lens, int num_heads, int partition_size,
                           int max_partitions) {
    using namespace pa;
    constexpr int RP = 256;  // partition weights staged per pass
    __shared__ float s_red[NWARPS];
    __shared__ float s_w[RP];
    __shared__ float s_lane[NT];
    const int h = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int width = HS / (int)gridDim.z, c0 = (int)blockIdx.z * width;
    const int cols = width < NT ? width : NT;  // columns per pass of the CTA
    const int lanes = NT / cols;               // partition lanes
    const int col = tid % cols, pl = tid / cols;  // pl >= lanes: idle (NT is not a multiple of cols)
    const hal_i64 sh = (hal_i64)s * num_heads + h;
    hal_t* o = out + sh * HS + c0;
    const int seq_len = seq_lens[s];
    int np = (seq_len + partition_size - 1) / partition_size;
    np = np < max_partitions ? np : max_partitions;
    if (np <= 0) {
        for (int d = tid; d < width; d += NT) o[d] = hal_from_float(0.f);
        return;
    }
    const float* ml = max_logits + sh * max_partitions;
    const float* es = exp_sums + sh * max_partitions;
    __shared__ int s_bad;
    if (tid == 0) s_bad = 0;
    hal_barrier();
    for (int p = tid; p < np; p += NT)
        if (es[p] < 0.f) s_bad = 1;
    hal_barrier();
    if (s_bad != 0) {
        for (int d = tid; d < width; d += NT) o[d] = hal_from_float(0.f);
        return;
    }

    float mx = HAL_NEG_INF;
    for (int p = tid; p < np; p += NT) mx = fmaxf(mx, ml[p]);
    mx = hal_warp_max(mx);
    if (lane == 0) s_red[warp] = mx;
    hal_barrier();
    mx = s_red[0];
    for (int w = 1; w < NWARPS; ++w) mx = fmaxf(mx, s_red[w]);
    hal_barrier();

    float den = 0.f;
    for (int p = tid; p < np; p += NT) den += expf(ml[p] - mx) * es[p];
    den = hal_warp_sum(den);
    if (lane == 0) s_red[warp] = den;
    hal_barrier();
    den = 0.f;
    for (int w = 0; w < NWARPS; ++w) den += s_red[w];
    const float inv = den > 0.f ? 1.f / den : 0.f;

    const float* part = tmp_out + sh * max_partitions * HS + c0;
    for (int d0 = 0; d0 < width; d0 += cols) {
        const int d = d0 + col;
        const bool active = pl < lanes && d < width;
        float num = 0.f;
        for (int p0 = 0; p0 < np; p0 += RP) {
            const int n = np - p0 < RP ? np - p0 : RP;
            hal_barrier();  // the previous pass's weights are consumed
            for (int p = tid; p < n; p += NT) s_w[p] = expf(ml[p0 + p] - mx);
            hal_barrier();
            if (active) {
                const float* src = part + (hal_i64)p0 * HS + d;
                for (int p = pl; p < n; p += lanes) num += s_w[p] * src[(hal_i64)p * HS];
            }
        }
        if (lanes > 1) {  // uniform: add the other lanes' sums to lane 0's, in lane order
            s_lane[tid] = num;
            hal_barrier();
            for (int q = 1; q < lanes; ++q) num += s_lane[q * cols + col];
        }
        if (pl == 0 && active) o[d] = hal_from_float(num * inv);
    }
}
