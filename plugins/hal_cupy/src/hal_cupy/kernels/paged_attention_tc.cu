// Paged-attention decode on tensor cores (warp matrix instructions of level 80): one query token
// per sequence, the query heads of a GQA group forming the M dimension of
// mma.sync m16n8k16 (padded to 16 rows).
//
// Defines: HAL_DTYPE (1 f16, 2 bf16: query, caches and output), HAL_HEAD_SIZE
// (64, 128, 192 or 256).  Block 128 threads (4 warps).
//
// Grid (num_kv_heads * tiles, num_seqs, max_partitions) with tiles =
// ceil(group / 16): CTA (x, s, p) serves query heads [head0, head0 + n_valid)
// of KV head x / tiles over tokens [p * partition_size, (p + 1) *
// partition_size) of sequence s.  max_partitions == 1: the CTA writes the
// normalised output (zeros for an empty sequence) and the workspaces are not
// touched.  Otherwise it writes unnormalised fp32 partials, the max logit and
// the exp-sum per head (the layout of hal_paged_attention_split), which
// hal_paged_attention_reduce of paged_attention.cu merges; a partition that
// starts at or past seq_lens[s] writes nothing.
//
// Per CTA: the partition's block-table slice is copied to shared memory once
// (entries past PA_TC_BT are read from global memory, never past the last used
// block).  Chunks of CHUNK tokens of K and V go through two shared-memory
// stages with cp.async: chunk c + 1 is in flight while chunk c is computed.
// Tokens past the partition's end are zero-filled by cp.async without a read,
// so NaN in unused slots and blocks never reaches an MMA; their logits are
// -inf.  Two barriers per chunk: (A) chunk c has landed and everybody is done
// with chunk c - 1 (its stage is then refilled), (B) the logits are in shared
// memory.  Q K^T: each warp computes 8-token column tiles of the 16 x CHUNK
// logits over all (or half, when CHUNK is 16) of the head dimension, Q held in
// A fragments in registers.  Softmax: every warp reads all logits in the C
// fragment layout, which is the A fragment layout of P V, and updates the same
// running max and exp-sum (fp32, online, in base 2 with exp2; identical in every warp).  P V: warp w
// owns output columns [w * HS / 4, (w + 1) * HS / 4); V fragments come from
// ldmatrix.trans.  P is rounded to the cache dtype for the MMA and the exp-sum
// adds the rounded values, so the output is a convex combination of V rows.
//
// Non-finite values: a NaN logit (NaN in q or a used key) makes its row NaN, a
// +inf logit makes it NaN (inf - inf), a row of -inf logits gives 0/0 = NaN,
// NaN or inf in a used value row reaches the columns the reference says --
// the float64 reference's semantics.
//
// Index checks (hal_index_checks.cuh), before the block-table slice is used: a
// length outside [0, max_seq_len] or a table entry of the partition outside [0,
// num_blocks) is reported in error_flag and never read; the output rows are
// zeros (single pass) or the partition is marked with exp_sum -1, which the
// reduce step turns into zeros.
#include "hal_common.cuh"
#include "hal_index_checks.cuh"
#include "hal_mma.cuh"

namespace pa_tc {

constexpr int HS = HAL_HEAD_SIZE;
constexpr int NT = 128;
constexpr int WARP = 32;
constexpr int NWARPS = NT / WARP;
constexpr int ROWS = 16;  // query heads per CTA (MMA M)
// Tokens per chunk: a K + V stage of at most 16 KiB (HS <= 128: 32 tokens, else 16; HS 64: 64).
constexpr int CHUNK = HS == 64 ? 64 : HS <= 128 ? 32 : 16;
constexpr int STRIDE = HS + 8;  // shared row stride in elements: 16-byte padding against bank conflicts
constexpr int VECS = HS / 8;    // 16-byte pieces per K/V row
constexpr int NTILES = CHUNK / 8;                          // 8-token column tiles of the logits
constexpr int KSL = NWARPS > NTILES ? NWARPS / NTILES : 1;  // head-dimension slices of Q K^T
constexpr int WPK = NWARPS / KSL;                          // warps per slice
constexpr int NTPW = NTILES / WPK;                         // column tiles per warp
constexpr int KSTEPS = HS / 16 / KSL;                      // MMA k-steps per warp in Q K^T
constexpr int OCOLS = HS / NWARPS;                         // output columns per warp in P V
constexpr int OTILES = OCOLS / 8;
constexpr int PSTEPS = CHUNK / 16;  // MMA k-steps of P V
constexpr int PA_TC_BT = 512;       // block-table entries kept in shared memory

static_assert(HAL_DTYPE == HAL_F16 || HAL_DTYPE == HAL_BF16, "tensor-core attention takes f16 or bf16");
static_assert(HS % 64 == 0 && HS <= 256, "HAL_HEAD_SIZE must be 64, 128, 192 or 256");
static_assert(KSTEPS % 2 == 0 && OTILES % 2 == 0 && NTPW >= 1 && PSTEPS >= 1, "chunk layout");
static_assert((CHUNK * VECS) % NT == 0, "a chunk is whole rounds of 16-byte copies");
constexpr float LOG2E = 1.4426950408889634f;  // logits are kept in base 2: exp(x) = exp2(x * log2(e))
constexpr float LN2 = 0.6931471805599453f;

HAL_DEVICE void mma(float* d, const unsigned* a, const unsigned* b) {
#if HAL_DTYPE == HAL_F16
    hal_mma_m16n8k16_f16(d, a, b, d);
#else
    hal_mma_m16n8k16_bf16(d, a, b, d);
#endif
}

// Two floats rounded (to nearest even) to the cache dtype, packed, the lower element in the lower half: one
// cvt.rn.{f16,bf16}x2.f32 on the GPU; the host build rounds each with hal_from_float, the same function.
HAL_DEVICE unsigned pack2(float lo, float hi) {
#if defined(HAL_MMA_SYNC) && HAL_DTYPE == HAL_BF16
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#elif defined(HAL_MMA_SYNC)
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    return (unsigned)hal_from_float(lo) | ((unsigned)hal_from_float(hi) << 16);
#endif
}
HAL_DEVICE float low_half(unsigned w) { return hal_to_float(static_cast<hal_t>(w & 0xffffu)); }
HAL_DEVICE float high_half(unsigned w) { return hal_to_float(static_cast<hal_t>(w >> 16)); }

struct alignas(16) Shared {
    hal_t k[2][CHUNK][STRIDE];
    hal_t v[2][CHUNK][STRIDE];
    float logit[KSL][ROWS][CHUNK];
    int bt[PA_TC_BT];
};

// This thread's copies: token rows tok0 + r * TPR of a chunk (r < ROUNDS), 16-byte piece `vec` of each, when
// whole rows fit a round (FIXED_ROWS: every head size but 192); otherwise piece tid + r * NT of the chunk.
constexpr int ROUNDS = CHUNK * VECS / NT;
constexpr bool FIXED_ROWS = NT % VECS == 0;
constexpr int TPR = FIXED_ROWS ? NT / VECS : 1;  // token rows per round of 128 copies

// Where this thread's first token row of the next chunk is: table entry j (from b0), row rem in that block.
// Advanced by whole chunks with a few subtractions instead of a division per row.
struct Cursor {
    int j, rem;
};
HAL_DEVICE void advance(Cursor& c, int tokens, int block_size) {
    c.rem += tokens;
    while (c.rem >= block_size) {
        c.rem -= block_size;
        ++c.j;
    }
}

// Queues the cp.async copies of K and V for tokens [c0, c0 + CHUNK) into stage st (zeros past t1, no read).
// `cur` is this thread's first row of the chunk; `head_off` = kv_head * block_size * HS (+ vec * 8 with FIXED_ROWS),
// `block_stride` = num_kv_heads * block_size * HS.
HAL_DEVICE void load_chunk(Shared& sm, int st, const hal_t* HAL_RESTRICT key_cache,
                           const hal_t* HAL_RESTRICT value_cache, const int* HAL_RESTRICT block_table, int b0,
                           int c0, int t1, Cursor cur, hal_i64 block_stride, hal_i64 head_off, int block_size) {
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int piece = threadIdx.x + r * NT;
        const int tok = piece / VECS, vec = piece % VECS;
        hal_i64 off = 0;
        int bytes = 0;
        if (c0 + tok < t1) {
            int j = cur.j, rem = cur.rem;
            if (!FIXED_ROWS) {  // head size 192: rows are not fixed per thread, one division per row
                j = (c0 + tok) / block_size - b0;
                rem = (c0 + tok) % block_size;
            }
            const hal_i64 phys = j < PA_TC_BT ? sm.bt[j] : block_table[b0 + j];
            off = phys * block_stride + head_off + (hal_i64)rem * HS + (FIXED_ROWS ? 0 : vec * 8);
            bytes = 16;
        }
        hal_cp_async_cg16(&sm.k[st][tok][vec * 8], key_cache + off, bytes);
        hal_cp_async_cg16(&sm.v[st][tok][vec * 8], value_cache + off, bytes);
        if (FIXED_ROWS && r + 1 < ROUNDS) advance(cur, TPR, block_size);
    }
    hal_cp_async_commit();
}

// Attention of query rows [0, n_valid) (heads head0 + row) of sequence s over tokens [t0, t1), t0 < t1.
// Leaves in acc/m/l, per lane, rows g = lane / 4 and g + 8 of the output columns the warp owns.
HAL_DEVICE void attend(Shared& sm, const hal_t* HAL_RESTRICT query, const hal_t* HAL_RESTRICT key_cache,
                       const hal_t* HAL_RESTRICT value_cache, const int* HAL_RESTRICT block_table, float scale,
                       int s, int num_heads, int num_kv_heads, int kv_head, int head0, int n_valid,
                       int block_size, int t0, int t1, float (*acc)[4], float* m, float* l) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int g = lane >> 2, tig = lane & 3;
    const int ks = warp / WPK, wn = warp % WPK;

    // The partition's block-table slice, once.
    const int b0 = t0 / block_size, nb = (t1 - 1) / block_size - b0 + 1;
    for (int j = tid; j < nb && j < PA_TC_BT; j += NT) sm.bt[j] = block_table[b0 + j];

    // This warp's A fragments of Q (rows past n_valid are zero).
    unsigned qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i & 1);
            const int col = (ks * KSTEPS + kk) * 16 + 2 * tig + 8 * (i >> 1);
            unsigned w = 0;
            if (row < n_valid) {
                const hal_t* p = query + ((hal_i64)s * num_heads + head0 + row) * HS + col;
                w = (unsigned)p[0] | ((unsigned)p[1] << 16);
            }
            qa[kk][i] = w;
        }
#pragma unroll
    for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    m[0] = m[1] = HAL_NEG_INF;
    l[0] = l[1] = 0.f;
    hal_barrier();  // the block-table slice

    const hal_i64 block_stride = (hal_i64)num_kv_heads * block_size * HS;
    const hal_i64 head_off = (hal_i64)kv_head * block_size * HS + (FIXED_ROWS ? (tid % VECS) * 8 : 0);
    const int tfirst = t0 + tid / VECS;  // this thread's first row of chunk 0
    Cursor cur = {tfirst / block_size - b0, tfirst % block_size};
    const float scale2 = scale * LOG2E;
    load_chunk(sm, 0, key_cache, value_cache, block_table, b0, t0, t1, cur, block_stride, head_off, block_size);
    advance(cur, CHUNK, block_size);
    int st = 0;
    for (int c0 = t0; c0 < t1; c0 += CHUNK, st ^= 1) {
        hal_cp_async_wait_all();
        hal_barrier();  // (A) chunk c0 visible; stage st ^ 1 and the logits free
        if (c0 + CHUNK < t1) {
            load_chunk(sm, st ^ 1, key_cache, value_cache, block_table, b0, c0 + CHUNK, t1, cur, block_stride,
                       head_off, block_size);
            advance(cur, CHUNK, block_size);
        }

        // Logits of this warp's column tiles over its head-dimension slice.
#pragma unroll
        for (int j = 0; j < NTPW; ++j) {
            const int nt = wn + j * WPK;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                unsigned b[4];
                const int col = (ks * KSTEPS + kk) * 16 + 8 * (lane >> 3);
                hal_ldmatrix_x4(b, &sm.k[st][nt * 8 + (lane & 7)][col]);
                mma(c, qa[kk], b);
                mma(c, qa[kk + 1], b + 2);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) sm.logit[ks][g + 8 * (i >> 1)][nt * 8 + 2 * tig + (i & 1)] = c[i];
        }
        hal_barrier();  // (B) logits complete

        // Online softmax on rows g and g + 8 (the same in every warp).
        float p[NTILES][4];
        float mx[2] = {HAL_NEG_INF, HAL_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = g + 8 * (i >> 1), col = nt * 8 + 2 * tig + (i & 1);
                float v = sm.logit[0][row][col];
#pragma unroll
                for (int q = 1; q < KSL; ++q) v += sm.logit[q][row][col];
                v = c0 + col < t1 ? v * scale2 : HAL_NEG_INF;
                p[nt][i] = v;
                mx[i >> 1] = fmaxf(mx[i >> 1], v);
            }
        float alpha[2], msafe[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], hal_shfl_xor(mx[r], 1));
            mx[r] = fmaxf(mx[r], hal_shfl_xor(mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);  // NaN logits are ignored here and poison the sum
            msafe[r] = m_new == HAL_NEG_INF ? 0.f : m_new;
            alpha[r] = exp2f(m[r] - msafe[r]);
            m[r] = m_new;
        }
        // P rounded to the cache dtype in A-fragment words (row g: word 0, row g + 8: word 1 of each tile).
        unsigned pw[NTILES][2];
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned w = pack2(exp2f(p[nt][2 * h] - msafe[h]), exp2f(p[nt][2 * h + 1] - msafe[h]));
                pw[nt][h] = w;
                sum[h] += low_half(w) + high_half(w);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sum[r] += hal_shfl_xor(sum[r], 1);
            sum[r] += hal_shfl_xor(sum[r], 2);
            l[r] = l[r] * alpha[r] + sum[r];
        }

        // O[:, warp's columns] = alpha * O + P V.
#pragma unroll
        for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] *= alpha[i >> 1];
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {
            const unsigned a[4] = {pw[2 * kk][0], pw[2 * kk][1], pw[2 * kk + 1][0], pw[2 * kk + 1][1]};
#pragma unroll
            for (int nt = 0; nt < OTILES; nt += 2) {
                unsigned b[4];
                const int j = lane >> 3;
                hal_ldmatrix_x4_trans(b, &sm.v[st][kk * 16 + 8 * (j & 1) + (lane & 7)]
                                              [warp * OCOLS + nt * 8 + 8 * (j >> 1)]);
                mma(acc[nt], a, b);
                mma(acc[nt + 1], a, b + 2);
            }
        }
    }
}

// Maps blockIdx.x to (kv head, first query head, number of valid rows) for 16-row tiles.
HAL_DEVICE void head_tile(int num_heads, int num_kv_heads, int* kv_head, int* head0, int* n_valid) {
    const int group = num_heads / num_kv_heads;
    const int tiles = (group + ROWS - 1) / ROWS;
    const int tile = blockIdx.x % tiles;
    *kv_head = blockIdx.x / tiles;
    *head0 = *kv_head * group + tile * ROWS;
    const int left = group - tile * ROWS;
    *n_valid = left < ROWS ? left : ROWS;
}

}  // namespace pa_tc

HAL_GLOBAL void HAL_LAUNCH_BOUNDS(128)
hal_paged_attention_tc(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT tmp_out, float* HAL_RESTRICT max_logits,
                       float* HAL_RESTRICT exp_sums, const hal_t* HAL_RESTRICT query,
                       const hal_t* HAL_RESTRICT key_cache, const hal_t* HAL_RESTRICT value_cache,
                       const int* HAL_RESTRICT block_tables, const int* HAL_RESTRICT seq_lens, float scale,
                       int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq,
                       int partition_size, int max_partitions, int num_blocks, int max_seq_len,
                       int* HAL_RESTRICT error_flag) {
    using namespace pa_tc;
    __shared__ Shared sm;
    const int s = blockIdx.y, part = blockIdx.z;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane >> 2, tig = lane & 3;
    int kv_head, head0, n_valid;
    head_tile(num_heads, num_kv_heads, &kv_head, &head0, &n_valid);
    // Index checks: a bad length or block-table entry of this partition is never read (see the top).
    const int capacity = max_blocks_per_seq * block_size;
    const int limit = max_seq_len < capacity ? max_seq_len : capacity;
    const int raw_len = seq_lens[s];
    const bool bad_len = raw_len < 0 || raw_len > limit;
    const int seq_len = bad_len ? 0 : raw_len;  // in [0, limit] from here on
    const int t0 = part * partition_size;
    // One partition covers the whole sequence.
    const int t1 = max_partitions == 1 || seq_len - t0 < partition_size ? seq_len : t0 + partition_size;
    const int* table = block_tables + (hal_i64)s * max_blocks_per_seq;
    int code = bad_len ? HAL_ERR_SEQ_LENS : 0;
    if (t1 > t0 && !hal_block_table_ok(table, t0 / block_size, (t1 - 1) / block_size + 1, num_blocks, NT))
        code = HAL_ERR_BLOCK_TABLES;
    if (code != 0 && threadIdx.x == 0) hal_report_index_error(error_flag, code);
    const int col0 = warp * OCOLS + 2 * tig;

    if (max_partitions == 1 && (seq_len <= 0 || code != 0)) {  // an empty or unreadable sequence gives zeros
#pragma unroll
        for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = g + 8 * (i >> 1);
                if (row < n_valid)
                    out[((hal_i64)s * num_heads + head0 + row) * HS + col0 + nt * 8 + (i & 1)] = hal_from_float(0.f);
            }
        return;
    }
    if (code != 0) {  // split: mark the partition for the reduce step
        for (int row = threadIdx.x; row < n_valid; row += NT) {
            const hal_i64 sp = ((hal_i64)s * num_heads + head0 + row) * max_partitions + part;
            max_logits[sp] = 0.f;
            exp_sums[sp] = -1.f;
        }
        return;
    }
    if (t0 >= seq_len) return;

    float acc[OTILES][4], m[2], l[2];
    attend(sm, query, key_cache, value_cache, table, scale, s, num_heads, num_kv_heads, kv_head, head0, n_valid,
           block_size, t0, t1, acc, m, l);

#pragma unroll
    for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), d = col0 + nt * 8 + (i & 1);
            if (row >= n_valid) continue;
            const hal_i64 sh = (hal_i64)s * num_heads + head0 + row;
            if (max_partitions == 1) {
                out[sh * HS + d] = hal_from_float(acc[nt][i] / l[i >> 1]);  // l == 0: all logits -inf, NaN
            } else {
                const hal_i64 sp = sh * max_partitions + part;
                tmp_out[sp * HS + d] = acc[nt][i];
                if (warp == 0 && nt == 0 && tig == 0 && (i & 1) == 0) {
                    max_logits[sp] = m[i >> 1] * LN2;  // natural-log units, as the reduce step reads
                    exp_sums[sp] = l[i >> 1];
                }
            }
        }
}
