// Paged-attention kernels over a packed batch of sequences, each with one or more new tokens (decode, prefill,
// chunked prefill, mixed in one launch).
//
// Defines: HAL_DTYPE (0 f32, 1 f16, 2 bf16), HAL_HEAD_SIZE, HAL_GQA (rows of a CTA: (new token, query head)
// pairs of one KV head; 1, 2, 4 or 8), optional HAL_NUM_THREADS (128) and HAL_UNROLL (4, tokens per thread per
// chunk).  See README.md for the parameters and launch rules.
//
// Rows: sequence s has q_len new tokens (query rows query_start_loc[s] ..; one row s without query_start_loc)
// and each KV head serves `group` query heads, so s has q_len * group rows per KV head, token-major (row r is
// new token r / group, query head kv_head * group + r % group).  CTA (x, s, p) takes HAL_GQA consecutive rows
// of one KV head (x = kv_head * tiles + tile) and the keys of partition p that any of them sees: new token i
// sits at position L - q_len + i (L = seq_lens[s]) and sees the keys t <= position, the last `window` of them
// with a window (> 0).  Chunks of keys outside the rows' union are never loaded; keys a row does not see are
// masked out of its softmax.  Scores: scale * q.k, then softcap * tanh(score / softcap) (softcap > 0), then
// + alibi_slopes[h] * (t - position) (non-null slopes); sinks[h] (non-null) joins the softmax denominator.
//
// Index checks (hal_index_checks.cuh): a CTA reads a sequence only when query_start_loc starts at 0, never
// decreases and ends at num_tokens, q_len <= min(L, max_query_len), L lies in [0, max_seq_len] and the
// block-table entries of the keys it loads lie in [0, num_blocks); otherwise it reports the argument in
// error_flag and the sequence's rows are zeros (the single-pass kernel writes them when it can tell which rows
// are the sequence's, the split kernel marks its partition with exp_sum -1, which the reduce turns into zeros).
#include "hal_common.cuh"
#include "hal_index_checks.cuh"
#include "hal_attention_rows.cuh"

#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 128
#endif
#ifndef HAL_UNROLL
#define HAL_UNROLL 4
#endif

namespace pa {

using pa_rows::Args;
using pa_rows::row_first_key;
using pa_rows::row_index;
using pa_rows::row_position;
using pa_rows::Tile;

constexpr int HS = HAL_HEAD_SIZE;
constexpr int GQA = HAL_GQA;  // rows per CTA
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

// Attention of the tile's rows over keys [t0, t1) (each row masked to its own visible keys).  Leaves the
// unnormalised output in s_out and the running max and exp-sum per row in s_m / s_l (all in shared memory;
// a row that sees none of the keys keeps max -inf, exp-sum 0 and output 0).
HAL_DEVICE void attend(const Args& a, const Tile& tl, const int* HAL_RESTRICT block_table, int t0, int t1,
                       float (*s_logit)[CHUNK], float* s_m, float* s_l, float* s_alpha, float (*s_out)[HS]) {
    const int tid = threadIdx.x;
    const int lane = tid % WARP;
    const int warp = tid / WARP;
    const int vec = lane % LPT;
    const int slot = warp * SPW + lane / LPT;
    const int group = a.num_heads / a.num_kv_heads;

    // This lane's slice of the (pre-scaled) query rows, and each row's visible keys and ALiBi slope.
    float qf[GQA][REG];
    int lo[GQA], hi[GQA];
    float slope[GQA];
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
        const bool valid = g < tl.n_rows;
        const int r = tl.r0 + g;
        const hal_i64 row = valid ? row_index(a, tl, group, r) : 0;
        const int pos = row_position(tl, group, r);
        lo[g] = valid ? row_first_key(a, pos) : 0;
        hi[g] = valid ? pos + 1 : 0;
        slope[g] = valid && a.alibi_slopes != 0 ? a.alibi_slopes[row % a.num_heads] : 0.f;
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
            const int vi = vec + j * LPT;
            if (valid && vi < NVEC) {
                hal_unpack16(hal_load16(a.query + row * HS + vi * EPV), &qf[g][j * EPV]);
#pragma unroll
                for (int e = 0; e < EPV; ++e) qf[g][j * EPV + e] *= a.scale;
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
    const hal_i64 k_head = (hal_i64)tl.kv_head * a.k_stride[1], v_head = (hal_i64)tl.kv_head * a.v_stride[1];

    for (int c0 = t0; c0 < t1; c0 += CHUNK) {
        hal_i64 krow[HAL_UNROLL], vrow[HAL_UNROLL];
        bool ok[HAL_UNROLL];
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u) {
            const int t = c0 + u * SLOTS + slot;
            ok[u] = t < t1;
            krow[u] = 0;
            vrow[u] = 0;
            if (ok[u]) {
                const hal_i64 phys = block_table[t / a.block_size];
                const hal_i64 off = t % a.block_size;
                krow[u] = phys * a.k_stride[0] + k_head + off * a.k_stride[2];
                vrow[u] = phys * a.v_stride[0] + v_head + off * a.v_stride[2];
            }
        }
        hal_vec16 kv[HAL_UNROLL][VPL];
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const int vi = vec + j * LPT;
                kv[u][j] = ok[u] && vi < NVEC ? hal_load16(a.key_cache + krow[u] + vi * EPV)
                                              : make_uint4(0u, 0u, 0u, 0u);
            }
        // Scores: partial dot products, then a sum over the LPT lanes of a key; masked keys get -inf.
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u) {
            const int t = c0 + u * SLOTS + slot;
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
                if (a.softcap > 0.f) dot = a.softcap * tanhf(dot / a.softcap);
                dot += slope[g] * (float)(t - (hi[g] - 1));
                if (vec == 0) s_logit[g][u * SLOTS + slot] = ok[u] && t >= lo[g] && t < hi[g] ? dot : HAL_NEG_INF;
            }
        }
        // Issue the V loads before the softmax step so they overlap it.
#pragma unroll
        for (int u = 0; u < HAL_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const int vi = vec + j * LPT;
                kv[u][j] = ok[u] && vi < NVEC ? hal_load16(a.value_cache + vrow[u] + vi * EPV)
                                              : make_uint4(0u, 0u, 0u, 0u);
            }
        hal_barrier();

        // Online softmax update, one warp per row.  A row with no visible key so far keeps max -inf: its
        // weights are taken against 0 (exp(-inf) = 0; a NaN score stays NaN).
        for (int g = warp; g < GQA; g += NWARPS) {
            float mx = HAL_NEG_INF;
            for (int i = lane; i < CHUNK; i += WARP) mx = fmaxf(mx, s_logit[g][i]);
            mx = hal_warp_max(mx);
            const float m_old = s_m[g];
            const float m_new = fmaxf(m_old, mx);
            const float base = m_new == HAL_NEG_INF ? 0.f : m_new;
            float sum = 0.f;
            for (int i = lane; i < CHUNK; i += WARP) {
                const float p = expf(s_logit[g][i] - base);
                s_logit[g][i] = p;
                sum += p;
            }
            sum = hal_warp_sum(sum);
            if (lane == 0) {
                const float alpha = expf(m_old - base);
                s_alpha[g] = alpha;
                s_l[g] = s_l[g] * alpha + sum;
                s_m[g] = m_new;
            }
        }
        hal_barrier();

#pragma unroll
        for (int g = 0; g < GQA; ++g) {
            const float al = s_alpha[g];
#pragma unroll
            for (int e = 0; e < REG; ++e) acc[g][e] *= al;
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

// Marks partition p of the tile's rows as unusable (exp_sum -1: the reduce step writes zeros for them).
HAL_DEVICE void mark_partition(const Args& a, const Tile& tl, float* HAL_RESTRICT max_logits,
                               float* HAL_RESTRICT exp_sums, int p, int max_partitions) {
    const int group = a.num_heads / a.num_kv_heads;
    for (int g = threadIdx.x; g < tl.n_rows; g += NT) {
        const hal_i64 sp = row_index(a, tl, group, tl.r0 + g) * max_partitions + p;
        max_logits[sp] = 0.f;
        exp_sums[sp] = -1.f;
    }
}

}  // namespace pa

// Single pass: one CTA covers every key its rows see and writes their final output.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention(hal_t* HAL_RESTRICT out, HAL_PA_PARAMS, int num_blocks, int max_seq_len,
                    int* HAL_RESTRICT error_flag) {
    using namespace pa;
    __shared__ float s_logit[GQA][CHUNK];
    __shared__ float s_out[GQA][HS];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    const Args a = HAL_PA_ARGS;
    const Tile tl = pa_rows::make_tile<GQA>(a);
    const int group = num_heads / num_kv_heads;
    const int* table = block_tables + (hal_i64)tl.s * max_blocks_per_seq;
    if (pa_rows::check_indices(a, tl, table, tl.lo, tl.hi, num_blocks, max_seq_len, error_flag, NT) != 0) {
        for (int i = threadIdx.x; i < tl.n_rows * HS; i += NT)
            out[row_index(a, tl, group, tl.r0 + i / HS) * HS + i % HS] = hal_from_float(0.f);
        return;
    }
    if (tl.n_rows == 0) return;
    attend(a, tl, table, tl.lo, tl.hi, s_logit, s_m, s_l, s_alpha, s_out);
    for (int i = threadIdx.x; i < tl.n_rows * HS; i += NT) {
        const int g = i / HS, d = i % HS;
        const hal_i64 row = row_index(a, tl, group, tl.r0 + g);
        float m = s_m[g], l = s_l[g], o = s_out[g][d];
        if (sinks != 0) {  // the sink joins the max and the denominator
            const float sink = sinks[row % num_heads];
            const float top = fmaxf(m, sink);
            const float f = m == HAL_NEG_INF ? 0.f : expf(m - top);
            o *= f;
            l = l * f + expf(sink - top);
        }
        // A row that sees no key (a decode sequence of length 0) is zeros; l is >= 1 for finite scores, NaN when
        // a NaN/inf score made the softmax NaN (kept, as the reference does).
        const float v = row_position(tl, group, tl.r0 + g) >= 0 ? o / l : 0.f;
        out[row * HS + d] = hal_from_float(v);
    }
}

// Split-KV: CTA (x, s, p) covers the keys [p * partition_size, (p + 1) * partition_size) its rows see and
// writes, per row, the unnormalised fp32 partial output, max score and exp-sum (max -inf, exp-sum 0 and zeros
// for a row that sees none of them).  Partitions starting at or beyond seq_lens[s] write nothing; one whose
// indices fail the checks (every one, for a bad length) is marked with exp_sum -1 instead.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention_split(float* HAL_RESTRICT tmp_out, float* HAL_RESTRICT max_logits,
                          float* HAL_RESTRICT exp_sums, HAL_PA_PARAMS, int partition_size, int max_partitions,
                          int num_blocks, int max_seq_len, int* HAL_RESTRICT error_flag) {
    using namespace pa;
    __shared__ float s_logit[GQA][CHUNK];
    __shared__ float s_out[GQA][HS];
    __shared__ float s_m[GQA], s_l[GQA], s_alpha[GQA];
    const Args a = HAL_PA_ARGS;
    const Tile tl = pa_rows::make_tile<GQA>(a);
    const int group = num_heads / num_kv_heads;
    const int p = blockIdx.z;
    const int p0 = p * partition_size;
    const int p1 = tl.seq_len - p0 < partition_size ? tl.seq_len : p0 + partition_size;
    const int t0 = p0 > tl.lo ? p0 : tl.lo;
    int t1 = p1 < tl.hi ? p1 : tl.hi;
    t1 = t1 > t0 ? t1 : t0;
    const int* table = block_tables + (hal_i64)tl.s * max_blocks_per_seq;
    if (pa_rows::check_indices(a, tl, table, t0, t1, num_blocks, max_seq_len, error_flag, NT) != 0) {
        mark_partition(a, tl, max_logits, exp_sums, p, max_partitions);
        return;
    }
    if (tl.n_rows == 0 || p0 >= tl.seq_len) return;
    attend(a, tl, table, t0, t1, s_logit, s_m, s_l, s_alpha, s_out);
    for (int i = threadIdx.x; i < tl.n_rows * HS; i += NT) {
        const int g = i / HS, d = i % HS;
        const hal_i64 sp = row_index(a, tl, group, tl.r0 + g) * max_partitions + p;
        tmp_out[sp * HS + d] = s_out[g][d];
        if (d == 0) {
            max_logits[sp] = s_m[g];
            exp_sums[sp] = s_l[g];
        }
    }
}

// Merges the partitions of hal_paged_attention_split (or hal_paged_attention_tc) with log-sum-exp.
// Grid (num_heads, num_tokens, slices), HAL_NUM_THREADS threads: CTA (h, q, z) writes columns
// [z * HS / slices, (z + 1) * HS / slices) of head h of query row q (slices divides HS; more slices fill a
// device that has more compute units than heads x rows).  Row q belongs to the sequence s whose
// query_start_loc range holds it (a binary search; s = q without query_start_loc), whose partitions
// p < ceil(seq_lens[s] / partition_size) are read.  The partitions' weights exp(m_p - max) are computed once
// per CTA into shared memory, RP at a time; when a slice is narrower than the CTA, the threads split the
// partitions into lanes and add the lanes' sums in a fixed order at the end.  With sinks, sinks[h] joins the
// max and the denominator.  A partition marked by the index checks (exp_sum < 0; a real exp-sum is >= 0 or
// NaN), or a row whose sequence's query_start_loc entries cannot place it, makes the output zeros.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_paged_attention_reduce(hal_t* HAL_RESTRICT out, const float* HAL_RESTRICT tmp_out,
                           const float* HAL_RESTRICT max_logits, const float* HAL_RESTRICT exp_sums,
                           const int* HAL_RESTRICT seq_lens, const int* HAL_RESTRICT query_start_loc,
                           const float* HAL_RESTRICT sinks, int num_heads, int num_seqs, int max_query_len,
                           int partition_size, int max_partitions) {
    using namespace pa;
    constexpr int RP = 256;  // partition weights staged per pass
    __shared__ float s_red[NWARPS];
    __shared__ float s_w[RP];
    __shared__ float s_lane[NT];
    const int h = blockIdx.x, q = blockIdx.y;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int width = HS / (int)gridDim.z, c0 = (int)blockIdx.z * width;
    const int cols = width < NT ? width : NT;  // columns per pass of the CTA
    const int lanes = NT / cols;               // partition lanes
    const int col = tid % cols, pl = tid / cols;  // pl >= lanes: idle (NT is not a multiple of cols)
    const hal_i64 sh = (hal_i64)q * num_heads + h;
    hal_t* o = out + sh * HS + c0;
    int s = q;
    bool placed = true;
    if (query_start_loc != 0) {  // the last sequence whose first row is <= q
        int lo = 0, hi = num_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (query_start_loc[mid] <= q) lo = mid; else hi = mid - 1;
        }
        s = lo;
        const int q0 = query_start_loc[s], q1 = query_start_loc[s + 1];
        placed = q0 >= 0 && q0 <= q && q < q1 && q1 <= (int)gridDim.y && q1 - q0 <= max_query_len;
    }
    const int seq_len = placed ? seq_lens[s] : 0;
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
    const float sink = sinks != 0 ? sinks[h] : HAL_NEG_INF;
    mx = fmaxf(mx, sink);
    hal_barrier();

    float den = 0.f;
    for (int p = tid; p < np; p += NT) den += expf(ml[p] - mx) * es[p];
    den = hal_warp_sum(den);
    if (lane == 0) s_red[warp] = den;
    hal_barrier();
    den = 0.f;
    for (int w = 0; w < NWARPS; ++w) den += s_red[w];
    if (sinks != 0) den += expf(sink - mx);
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
            for (int k = 1; k < lanes; ++k) num += s_lane[k * cols + col];
        }
        if (pl == 0 && active) o[d] = hal_from_float(num * inv);
    }
}
