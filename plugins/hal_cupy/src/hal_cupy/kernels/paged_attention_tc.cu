// Paged attention on tensor cores (warp matrix instructions of level 80): 16 rows per CTA -- (new token,
// query head) pairs of one KV head, token-major (hal_attention_rows.cuh) -- form the M dimension of
// mma.sync m16n8k16.  Decode (one new token per sequence) gives a CTA the query heads of a GQA group (padded
// to 16 rows); prefill, chunked prefill and mixed batches (query_start_loc) give it the heads of consecutive
// new tokens.  Sliding window, softcap, sinks and ALiBi as in paged_attention.cu; the caches' element strides
// are the key cache's (the value cache must have the same strides).
//
// Defines: HAL_DTYPE (1 f16, 2 bf16: query, caches and output), HAL_HEAD_SIZE
// (64, 128, 192 or 256), HAL_VARLEN (0: the decode build -- one new token per sequence, C-contiguous caches,
// no window, softcap, sinks or ALiBi; the parameters for them are taken and unused; 1: the build above, every
// row masked to the keys it sees, softcap, ALiBi and sinks, the caches' strides).  Both builds run one main loop
// (attend) of shared device functions -- chunk_rows and load_chunk (the pipeline), qk_logits (Q K^T),
// online_softmax and p_fragments, pv (P V), merge, then store -- and differ in the mask type (DecodeMask: the
// partition's end; VarlenMask: each row's keys, softcap, ALiBi), the tile mapping and the index checks, so the
// decode build does not pay for the masks.  Block 128 threads (4 warps).
//
// Grid (num_kv_heads * ceil(max_query_len * group / 16), num_seqs, max_partitions): CTA (x, s, p) serves its 16
// rows over the keys of partition p of sequence s they see.  max_partitions == 1 writes the normalised output;
// else fp32 partials, max logit and exp-sum per row, which hal_paged_attention_reduce merges.
// The main loop (the two-stage cp.async pipeline, the warps' token and column groups, the merge), non-finite
// values and the index checks: kernels/README.md, paged_attention_tc.cu.
#include "hal_common.cuh"
#include "hal_index_checks.cuh"
#include "hal_attention_rows.cuh"
#include "hal_mma.cuh"

#ifndef HAL_VARLEN
#define HAL_VARLEN 0
#endif

namespace pa_tc {

constexpr int HS = HAL_HEAD_SIZE;
constexpr int NT = 128;
constexpr int WARP = 32;
constexpr int NWARPS = NT / WARP;
constexpr int ROWS = 16;  // rows per CTA (MMA M)
// Tokens per chunk: a K + V stage of at most 16 KiB (HS <= 128: 32 tokens, else 16; HS 64: 64).
constexpr int CHUNK = HS == 64 ? 64 : HS <= 128 ? 32 : 16;
constexpr int STRIDE = HS + 8;  // shared row stride in elements: 16-byte padding against bank conflicts
constexpr int VECS = HS / 8;    // 16-byte pieces per K/V row
constexpr int TG = CHUNK / 8 < NWARPS ? CHUNK / 8 : NWARPS;  // token groups (warps along the tokens)
constexpr int CG = NWARPS / TG;                               // column groups (warps along the output)
constexpr int TW = CHUNK / TG;                                // tokens per warp and chunk: 8 or 16
constexpr int NTW = TW / 8;                                   // 8-token logit tiles per warp
constexpr int PSTEPS = TW / 16;                               // k16 steps of P V (0: one k8 step)
constexpr int KSTEPS = HS / 16;                               // MMA k-steps of Q K^T
constexpr int OCOLS = HS / CG;                                // output columns per warp
constexpr int OTILES = OCOLS / 8;
constexpr int OSTRIDE = HS + 4;  // row stride (floats) of the merge buffer: rows g and g + 1 on other banks
constexpr int PA_TC_BT = 512;    // block-table entries kept in shared memory

static_assert(HAL_DTYPE == HAL_F16 || HAL_DTYPE == HAL_BF16, "tensor-core attention takes f16 or bf16");
static_assert(HS % 64 == 0 && HS <= 256, "HAL_HEAD_SIZE must be 64, 128, 192 or 256");
static_assert(TG * CG == NWARPS && TW % 8 == 0 && (TW == 8 || TW % 16 == 0) && KSTEPS % 2 == 0, "chunk layout");
static_assert(OTILES % (TW == 8 ? 4 : 2) == 0, "whole ldmatrix.x4.trans per warp");
static_assert((CHUNK * VECS) % NT == 0, "a chunk is whole rounds of 16-byte copies");
static_assert(TG * ROWS * OSTRIDE * 4 <= 2 * 2 * CHUNK * STRIDE * 2, "the merge buffer fits the K/V stages");
constexpr float LOG2E = 1.4426950408889634f;  // logits are kept in base 2: exp(x) = exp2(x * log2(e))
constexpr float LN2 = 0.6931471805599453f;
// 1.0 in both halves of a packed pair (the B operand of the exp-sum MMA).
constexpr unsigned ONES = HAL_DTYPE == HAL_F16 ? 0x3c003c00u : 0x3f803f80u;

HAL_DEVICE void mma(float* d, const unsigned* a, const unsigned* b) {
#if HAL_DTYPE == HAL_F16
    hal_mma_m16n8k16_f16(d, a, b, d);
#else
    hal_mma_m16n8k16_bf16(d, a, b, d);
#endif
}
HAL_DEVICE void mma_k8(float* d, const unsigned* a, const unsigned* b) {
#if HAL_DTYPE == HAL_F16
    hal_mma_m16n8k8_f16(d, a, b, d);
#else
    hal_mma_m16n8k8_bf16(d, a, b, d);
#endif
}

// 2^x: one MUFU.EX2 on the GPU (the instruction exp2f becomes under CuPy's -ftz=true build); exp2f on the host.
HAL_DEVICE float exp2_fast(float x) {
#if defined(HAL_MMA_SYNC)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
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

struct KVStages {
    hal_t k[2][CHUNK][STRIDE];
    hal_t v[2][CHUNK][STRIDE];
};
struct alignas(16) Shared {
    union {
        KVStages kv;                   // the main loop
        float o[TG][ROWS][OSTRIDE];    // then the token groups' unnormalised outputs
    } u;
    hal_i64 row_off[2][CHUNK];  // byte offset of each token row of the next chunks in the caches (0: past t1)
    float m[TG][ROWS], l[TG][ROWS];  // per token group: max logit (base 2) and exp-sum of each row
    float fac[TG][ROWS];             // merge weights 2^(m_g - max_g m_g)
    float row_m[ROWS], row_l[ROWS];  // merged max logit (base 2) and exp-sum
    int bt[PA_TC_BT];
};

// This thread's copies: piece tid + r * NT of a chunk (token row piece / VECS, 16-byte piece piece % VECS).
constexpr int ROUNDS = CHUNK * VECS / NT;

// Where in the caches the rows of the chunk at c0 are: thread tid < CHUNK writes the byte offset of token
// c0 + tid (0 past t1) into row_off[buf].  Block index by a multiply-high with `magic` = (2^32 - 1) / block_size,
// which is low by at most one (corrected), instead of a division.
HAL_DEVICE void chunk_rows(Shared& sm, int buf, const int* HAL_RESTRICT block_table, int b0, int c0, int t1,
                           unsigned magic, hal_i64 block_stride, hal_i64 head_off, hal_i64 token_stride,
                           int block_size) {
    const int tid = threadIdx.x;
    if (tid >= CHUNK) return;
    const int t = c0 + tid;
    hal_i64 off = 0;
    if (t < t1) {
        int q = (int)(((unsigned long long)(unsigned)t * magic) >> 32);
        int rem = t - q * block_size;
        if (rem >= block_size) {
            ++q;
            rem -= block_size;
        }
        const int j = q - b0;
        const hal_i64 phys = j < PA_TC_BT ? sm.bt[j] : block_table[b0 + j];
        off = (phys * block_stride + head_off + (hal_i64)rem * token_stride) * (hal_i64)sizeof(hal_t);
    }
    sm.row_off[buf][tid] = off;
}

// Queues the cp.async copies of K and V of the chunk whose row offsets are in row_off[st] into stage st;
// rows at or past `left` (tokens left in the partition) are zero-filled without a read.
HAL_DEVICE void load_chunk(Shared& sm, int st, const hal_t* HAL_RESTRICT key_cache,
                           const hal_t* HAL_RESTRICT value_cache, int left) {
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int piece = threadIdx.x + r * NT;
        const int tok = piece / VECS, col = (piece % VECS) * 8;
        const hal_i64 off = sm.row_off[st][tok];
        const int bytes = tok < left ? 16 : 0;
        hal_cp_async_cg16(&sm.u.kv.k[st][tok][col],
                          reinterpret_cast<const char*>(key_cache + col) + off, bytes);
        hal_cp_async_cg16(&sm.u.kv.v[st][tok][col],
                          reinterpret_cast<const char*>(value_cache + col) + off, bytes);
    }
    hal_cp_async_commit();
}

// This warp's A fragments of Q: rows g and g + 8 are query rows qrow[0] and qrow[1] (zero at or past n_rows).
HAL_DEVICE void load_q(unsigned (&qa)[KSTEPS][4], const hal_t* HAL_RESTRICT query, const hal_i64 (&qrow)[2],
                       int n_rows, int g, int tig) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i & 1);
            const int col = kk * 16 + 2 * tig + 8 * (i >> 1);
            unsigned w = 0;
            if (row < n_rows) {
                const hal_t* p = query + qrow[i & 1] * HS + col;
                w = (unsigned)p[0] | ((unsigned)p[1] << 16);
            }
            qa[kk][i] = w;
        }
}

// Q K^T of this warp's tokens of stage st: NTW tiles of 16 x 8 over the whole head dimension (two accumulator
// chains per tile, even and odd k-steps, so that consecutive MMAs do not wait for each other).
HAL_DEVICE void qk_logits(float (&c)[NTW][4], const Shared& sm, int st, int tok0, int lane,
                          const unsigned (&qa)[KSTEPS][4]) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
        float c2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk += 2) {
            unsigned b[4];
            hal_ldmatrix_x4(b, &sm.u.kv.k[st][tok0 + nt * 8 + (lane & 7)][kk * 16 + 8 * (lane >> 3)]);
            mma(c[nt], qa[kk], b);
            mma(c2, qa[kk + 1], b + 2);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] += c2[i];
    }
}

// The decode build's logits: every row sees every key of the partition; keys at or past t1 are -inf.
// Key j of the warp's chunk (j = nt * 8 + (i & 1) of its C fragments) is token tbase + j.
struct DecodeMask {
    float scale2;  // scale * log2(e)
    int lim;       // keys of this chunk before t1, counted from tbase
};
HAL_DEVICE void mask_chunk(DecodeMask& m, int tbase, int t1) { m.lim = t1 - tbase; }
HAL_DEVICE float mask_logit(const DecodeMask& m, float c, int j, int) { return j < m.lim ? c * m.scale2 : HAL_NEG_INF; }

// The HAL_VARLEN build's logits in base 2 for rows g (r = 0) and g + 8 (r = 1): softcap, ALiBi, and -inf for a
// key past t1 or one the row does not see ([lo, pos]).
struct VarlenMask {
    float scale2, cap2, cap_in;  // softcap in base 2: cap2 * tanh(c * cap_in) = log2(e) softcap tanh(scale c / softcap)
    float slope2[2];             // ALiBi slopes in base 2 (0: none)
    int lo[2], pos[2];           // the keys each row sees (none for a row past n_rows)
    int tbase, t1;
};
HAL_DEVICE void mask_chunk(VarlenMask& m, int tbase, int t1) { m.tbase = tbase, m.t1 = t1; }
HAL_DEVICE float mask_logit(const VarlenMask& m, float c, int j, int r) {
    const int t = m.tbase + j;
    float v = m.cap_in > 0.f ? m.cap2 * tanhf(c * m.cap_in) : c * m.scale2;
    v += m.slope2[r] * (float)(t - m.pos[r]);
    return t < m.t1 && t >= m.lo[r] && t <= m.pos[r] ? v : HAL_NEG_INF;
}

// Online softmax of rows g and g + 8 over this warp's logits c (masked in place): the running max m, the factor
// alpha that rescales what was accumulated, and msafe, the max the weights are taken against (0 for -inf).
template <class Mask>
HAL_DEVICE void online_softmax(float (&c)[NTW][4], float (&m)[2], float (&alpha)[2], float (&msafe)[2],
                               const Mask& mask) {
    float mx[2] = {HAL_NEG_INF, HAL_NEG_INF};
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float v = mask_logit(mask, c[nt][i], nt * 8 + (i & 1), i >> 1);
            c[nt][i] = v;
            mx[i >> 1] = fmaxf(mx[i >> 1], v);
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], hal_shfl_xor(mx[r], 1));
        mx[r] = fmaxf(mx[r], hal_shfl_xor(mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r]);  // NaN logits are ignored here and poison the sum
        msafe[r] = m_new == HAL_NEG_INF ? 0.f : m_new;
        alpha[r] = exp2_fast(m[r] - msafe[r]);
        m[r] = m_new;
    }
}

// P rounded to the cache dtype: the C fragments' pairs are the A fragment's words of P V (tile nt, row half h:
// word 2 nt + h; a k16 step takes the words of two tiles, the k8 step of one).
HAL_DEVICE void p_fragments(unsigned (&pa)[2 * NTW], const float (&c)[NTW][4], const float (&msafe)[2]) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            pa[2 * nt + h] = pack2(exp2_fast(c[nt][2 * h] - msafe[h]), exp2_fast(c[nt][2 * h + 1] - msafe[h]));
}

// O = alpha * O + P V; exp-sum = alpha * l + P 1 (V fragments of stage st from ldmatrix.trans).
HAL_DEVICE void pv(float (&acc)[OTILES][4], float (&lsum)[4], const unsigned (&pa)[2 * NTW],
                   const float (&alpha)[2], const unsigned (&ones)[2], const Shared& sm, int st, int tok0, int ocol0,
                   int lane) {
#pragma unroll
    for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] *= alpha[i >> 1];
#pragma unroll
    for (int i = 0; i < 4; ++i) lsum[i] *= alpha[i >> 1];
    const int j = lane >> 3;
    if (PSTEPS == 0) {  // 8 tokens: m16n8k8, ldmatrix.x4.trans matrices = tiles nt .. nt + 3
        mma_k8(lsum, pa, ones);
#pragma unroll
        for (int nt = 0; nt < OTILES; nt += 4) {
            unsigned b[4];
            hal_ldmatrix_x4_trans(b, &sm.u.kv.v[st][tok0 + (lane & 7)][ocol0 + (nt + j) * 8]);
#pragma unroll
            for (int q = 0; q < 4; ++q) mma_k8(acc[nt + q], pa, b + q);
        }
    }
#pragma unroll
    for (int ps = 0; ps < PSTEPS; ++ps) {  // 16 tokens each: matrices (tokens 0-7 | 8-15) x (tiles nt | nt + 1)
        const unsigned* a = pa + 4 * ps;
        mma(lsum, a, ones);
#pragma unroll
        for (int nt = 0; nt < OTILES; nt += 2) {
            unsigned b[4];
            hal_ldmatrix_x4_trans(
                b, &sm.u.kv.v[st][tok0 + 16 * ps + 8 * (j & 1) + (lane & 7)][ocol0 + (nt + (j >> 1)) * 8]);
            mma(acc[nt], a, b);
            mma(acc[nt + 1], a, b + 2);
        }
    }
}

// Merge the token groups: each writes its output, max and exp-sum; the rows' weights are computed once.
HAL_DEVICE void merge(Shared& sm, const float (&acc)[OTILES][4], const float (&m)[2], const float (&lsum)[4],
                      int tg, int cg, int g, int tig, int ocol0) {
    hal_barrier();  // every warp is done with the stages the merge buffer overlays
#pragma unroll
    for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sm.u.o[tg][g + 8 * (i >> 1)][ocol0 + nt * 8 + 2 * tig + (i & 1)] = acc[nt][i];
    if (cg == 0 && tig == 0) {  // every column of the exp-sum MMA holds the row's sum
        sm.m[tg][g] = m[0];
        sm.m[tg][g + 8] = m[1];
        sm.l[tg][g] = lsum[0];
        sm.l[tg][g + 8] = lsum[2];
    }
    hal_barrier();
    const int tid = threadIdx.x;
    if (tid < ROWS) {
        float mm = sm.m[0][tid];
#pragma unroll
        for (int q = 1; q < TG; ++q) mm = fmaxf(mm, sm.m[q][tid]);
        const float ms = mm == HAL_NEG_INF ? 0.f : mm;
        float l = 0.f;
#pragma unroll
        for (int q = 0; q < TG; ++q) {
            const float f = exp2_fast(sm.m[q][tid] - ms);
            sm.fac[q][tid] = f;
            l += f * sm.l[q][tid];
        }
        sm.row_m[tid] = mm;
        sm.row_l[tid] = l;
    }
    hal_barrier();
}

// Where the keys are: the block table of the sequence (block ids), the cache bases and the element strides.
struct Keys {
    const hal_t* HAL_RESTRICT key_cache;
    const hal_t* HAL_RESTRICT value_cache;
    const int* HAL_RESTRICT block_table;
    int block_size;
    hal_i64 block_stride, head_off, token_stride;  // head_off: the KV head's offset
};

// Attention of the CTA's rows (this warp's rows g, g + 8: query rows qrow[0], qrow[1]; zero at or past n_rows)
// over keys [t0, t1), t0 < t1, each logit masked by `mask`.  Leaves in shared memory the token groups' outputs
// (u.o), merge weights (fac), and each row's merged max logit and exp-sum (row_m, row_l): row r, column d is
// sum_g fac[g][r] * u.o[g][r][d] (divided by row_l[r] when normalised).
template <class Mask>
HAL_DEVICE void attend(Shared& sm, const hal_t* HAL_RESTRICT query, const hal_i64 (&qrow)[2], int n_rows,
                       const Keys& k, int t0, int t1, Mask mask) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int g = lane >> 2, tig = lane & 3;
    const int tg = warp / CG, cg = warp % CG;
    const int tok0 = tg * TW, ocol0 = cg * OCOLS;
    const int block_size = k.block_size;

    // The partition's block-table slice, once.
    const int b0 = t0 / block_size, nb = (t1 - 1) / block_size - b0 + 1;
    for (int j = tid; j < nb && j < PA_TC_BT; j += NT) sm.bt[j] = k.block_table[b0 + j];

    unsigned qa[KSTEPS][4];
    load_q(qa, query, qrow, n_rows, g, tig);
    float acc[OTILES][4], lsum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < OTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    float m[2] = {HAL_NEG_INF, HAL_NEG_INF};
    const unsigned ones[2] = {ONES, ONES};  // B of the exp-sum MMA
    hal_barrier();  // the block-table slice

    const unsigned magic = 0xffffffffu / (unsigned)block_size;
    chunk_rows(sm, 0, k.block_table, b0, t0, t1, magic, k.block_stride, k.head_off, k.token_stride, block_size);
    hal_barrier();  // the rows of chunk 0
    load_chunk(sm, 0, k.key_cache, k.value_cache, t1 - t0);
    if (t0 + CHUNK < t1)
        chunk_rows(sm, 1, k.block_table, b0, t0 + CHUNK, t1, magic, k.block_stride, k.head_off, k.token_stride,
                   block_size);
    int st = 0;
    for (int c0 = t0; c0 < t1; c0 += CHUNK, st ^= 1) {
        hal_cp_async_wait_all();
        hal_barrier();  // chunk c0 visible; stage st ^ 1 free; the rows of chunk c0 + CHUNK visible
        if (c0 + CHUNK < t1) {
            load_chunk(sm, st ^ 1, k.key_cache, k.value_cache, t1 - c0 - CHUNK);
            if (c0 + 2 * CHUNK < t1)
                chunk_rows(sm, st, k.block_table, b0, c0 + 2 * CHUNK, t1, magic, k.block_stride, k.head_off,
                           k.token_stride, block_size);
        }
        float c[NTW][4];
        qk_logits(c, sm, st, tok0, lane, qa);
        mask_chunk(mask, c0 + tok0 + 2 * tig, t1);  // C fragment (nt, i) holds key c0 + tok0 + 2 tig + nt * 8 + (i & 1)
        float alpha[2], msafe[2];
        online_softmax(c, m, alpha, msafe, mask);
        unsigned pa[2 * NTW];
        p_fragments(pa, c, msafe);
        pv(acc, lsum, pa, alpha, ones, sm, st, tok0, ocol0, lane);
    }
    merge(sm, acc, m, lsum, tg, cg, g, tig, ocol0);
}

// Row `row` of the CTA (< n_rows) is query/out row row_of(rows, row) (query/out row * heads + head).
struct DecodeRows {  // the GQA group's heads head0 .. of sequence s
    int s, num_heads, head0;
};
struct VarlenRows {  // the tile's (new token, query head) rows
    const pa_rows::Args& a;
    const pa_rows::Tile& tl;
    int group;
};
HAL_DEVICE hal_i64 row_of(const DecodeRows& r, int row) { return (hal_i64)r.s * r.num_heads + r.head0 + row; }
HAL_DEVICE hal_i64 row_of(const VarlenRows& r, int row) {
    return pa_rows::row_index(r.a, r.tl, r.group, r.tl.r0 + row);
}

// A sequence whose indices are bad: single pass, zeros for its rows; split, the partition marked for the reduce
// step (exp-sum -1).
template <class Rows>
HAL_DEVICE void refuse(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT max_logits, float* HAL_RESTRICT exp_sums,
                       const Rows& rows, int n_rows, int max_partitions, int part) {
    if (max_partitions == 1) {
        for (int e = threadIdx.x; e < n_rows * HS; e += NT)
            out[row_of(rows, e / HS) * HS + e % HS] = hal_from_float(0.f);
        return;
    }
    for (int row = threadIdx.x; row < n_rows; row += NT) {
        const hal_i64 sp = row_of(rows, row) * max_partitions + part;
        max_logits[sp] = 0.f;
        exp_sums[sp] = -1.f;
    }
}

// After attend: the normalised rows (single pass; with sinks, the sink joins the max and the denominator), or
// the partition's unnormalised partials, max logit (natural-log units, as the reduce step reads) and exp-sum.
template <class Rows>
HAL_DEVICE void store(const Shared& sm, hal_t* HAL_RESTRICT out, float* HAL_RESTRICT tmp_out,
                      float* HAL_RESTRICT max_logits, float* HAL_RESTRICT exp_sums, const float* HAL_RESTRICT sinks,
                      int num_heads, const Rows& rows, int n_rows, int max_partitions, int part) {
    for (int e = threadIdx.x; e < n_rows * HS; e += NT) {
        const int row = e / HS, d = e % HS;
        float o = 0.f;
#pragma unroll
        for (int q = 0; q < TG; ++q) o += sm.fac[q][row] * sm.u.o[q][row][d];
        const hal_i64 sh = row_of(rows, row);
        if (max_partitions == 1) {
            float l = sm.row_l[row];  // l == 0: all logits -inf, NaN
            if (sinks != 0) {  // base 2
                const float m = sm.row_m[row], sink = sinks[sh % num_heads] * LOG2E;
                const float top = fmaxf(m, sink);
                const float f = m == HAL_NEG_INF ? 0.f : exp2_fast(m - top);
                o *= f;
                l = l * f + exp2_fast(sink - top);
            }
            out[sh * HS + d] = hal_from_float(o / l);
        } else {
            const hal_i64 sp = sh * max_partitions + part;
            tmp_out[sp * HS + d] = o;
            if (d == 0) {
                max_logits[sp] = sm.row_m[row] * LN2;
                exp_sums[sp] = sm.row_l[row];
            }
        }
    }
}

// The index checks (README): 0, or the code of the argument whose values this CTA must not read (reported
// once).  Cooperative (hal_query_starts_ok with query_start_loc, hal_block_table_ok).  Kept out of line on the
// device so that none of its values stays live in the registers the main loop needs.
#if defined(HAL_HOST)
HAL_DEVICE
#else
__device__ __noinline__
#endif
int check_indices(const int* HAL_RESTRICT query_start_loc, int num_tokens, bool rows_bad, bool bad_len,
                  const int* HAL_RESTRICT table, int t0, int t1, int block_size, int num_blocks,
                  int* HAL_RESTRICT error_flag) {
    int code = 0;
#if HAL_VARLEN
    if (query_start_loc != 0 && (!hal_query_starts_ok(query_start_loc, (int)gridDim.y, num_tokens, NT) || rows_bad))
        code = HAL_ERR_QUERY_START_LOC;
#endif
    if (bad_len)
        code |= HAL_ERR_SEQ_LENS;
    else if (code == 0 && t1 > t0 &&
             !hal_block_table_ok(table, t0 / block_size, (t1 - 1) / block_size + 1, num_blocks, NT))
        code = HAL_ERR_BLOCK_TABLES;
    if (code != 0 && threadIdx.x == 0) hal_report_index_error(error_flag, code);
    return code;
}
}  // namespace pa_tc

// Resident CTAs per SM the register allocation is held to (decode: d=64: 4, d=128 and 192: 3, d=256: 2; the
// HAL_VARLEN build, whose masks hold a few more registers, one fewer down to 2), so that a few registers more or
// less do not move the kernel off the occupancy the partition rule expects.
#if defined(HAL_MMA_SYNC) && HAL_VARLEN
#define PA_TC_LAUNCH_BOUNDS __launch_bounds__(128, HAL_HEAD_SIZE == 64 ? 3 : 2)
#elif defined(HAL_MMA_SYNC)
#define PA_TC_LAUNCH_BOUNDS __launch_bounds__(128, HAL_HEAD_SIZE == 64 ? 4 : HAL_HEAD_SIZE == 256 ? 2 : 3)
#else
#define PA_TC_LAUNCH_BOUNDS HAL_LAUNCH_BOUNDS(128)
#endif

HAL_GLOBAL void PA_TC_LAUNCH_BOUNDS
hal_paged_attention_tc(hal_t* HAL_RESTRICT out, float* HAL_RESTRICT tmp_out, float* HAL_RESTRICT max_logits,
                       float* HAL_RESTRICT exp_sums, HAL_PA_PARAMS, int partition_size, int max_partitions,
                       int num_blocks, int max_seq_len, int* HAL_RESTRICT error_flag) {
    using namespace pa_tc;
    __shared__ Shared sm;
    const int part = blockIdx.z;
    const int capacity = max_blocks_per_seq * block_size;
    const int limit = max_seq_len < capacity ? max_seq_len : capacity;
    const int g = (threadIdx.x % WARP) >> 2;  // this thread's rows of the MMA: g and g + 8
#if HAL_VARLEN
    const pa_rows::Args a = HAL_PA_ARGS;
    const pa_rows::Tile tl = pa_rows::make_tile<ROWS>(a);
    const int group = num_heads / num_kv_heads;
    const int s = tl.s, n_rows = tl.n_rows;
    const VarlenRows rows{a, tl, group};
    // Index checks: bad query_start_loc entries, a bad length or block-table entry is never read.
    const bool bad_len = tl.seq_len < 0 || tl.seq_len > limit;
    const int seq_len = bad_len ? 0 : tl.seq_len;  // in [0, limit] from here on
    const int p0 = part * partition_size;
    // One partition covers the whole sequence; the CTA loads the keys of [t0, t1) (its rows' union in it).
    const int p1 = max_partitions == 1 || seq_len - p0 < partition_size ? seq_len : p0 + partition_size;
    const int t0 = p0 > tl.lo ? p0 : tl.lo;
    int t1 = p1 < tl.hi ? p1 : tl.hi;
    t1 = t1 > t0 ? t1 : t0;
    const int* table = block_tables + (hal_i64)s * max_blocks_per_seq;
    const bool rows_bad = !tl.rows_known || tl.q_len > tl.seq_len;
    const int code = check_indices(query_start_loc, num_tokens, rows_bad, bad_len, table, t0, t1, block_size,
                                   num_blocks, error_flag);
    if (code != 0 || (max_partitions == 1 && t0 >= t1)) {  // an empty or unreadable sequence gives zeros
        refuse(out, max_logits, exp_sums, rows, n_rows, code != 0 ? max_partitions : 1, part);
        return;
    }
    if (n_rows == 0 || p0 >= seq_len) return;
    if (t0 >= t1) {  // split: none of the rows sees a key of this partition
        for (int e = threadIdx.x; e < n_rows * HS; e += NT) {
            const hal_i64 sp = row_of(rows, e / HS) * max_partitions + part;
            tmp_out[sp * HS + e % HS] = 0.f;
            if (e % HS == 0) {
                max_logits[sp] = HAL_NEG_INF;
                exp_sums[sp] = 0.f;
            }
        }
        return;
    }
    // Rows g and g + 8: their query rows, the keys they see ([lo, pos]; none past n_rows), their ALiBi slopes.
    hal_i64 qrow[2];
    VarlenMask mask;
    mask.scale2 = scale * LOG2E;
    mask.cap2 = softcap * LOG2E;
    mask.cap_in = softcap > 0.f ? scale / softcap : 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h;
        const bool valid = row < n_rows;
        qrow[h] = valid ? row_of(rows, row) : 0;
        mask.pos[h] = valid ? pa_rows::row_position(tl, group, tl.r0 + row) : -1;
        mask.lo[h] = valid ? pa_rows::row_first_key(a, mask.pos[h]) : 0;
        mask.slope2[h] = valid && alibi_slopes != 0 ? alibi_slopes[qrow[h] % num_heads] * LOG2E : 0.f;
    }
    const Keys keys{key_cache, value_cache, table, block_size, k_stride_block,
                    (hal_i64)tl.kv_head * k_stride_head, k_stride_token};
    const float* row_sinks = sinks;
#else
    // The decode build (no query_start_loc, window, softcap, sinks or ALiBi; C-contiguous caches): 16-row tiles
    // of the GQA group, blockIdx.x is (KV head, tile), rows are heads head0 .. of sequence s.
    const int s = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const int tiles = (group + ROWS - 1) / ROWS;
    const int kv_head = blockIdx.x / tiles;
    const int head0 = kv_head * group + (blockIdx.x % tiles) * ROWS;
    const int left = group - (blockIdx.x % tiles) * ROWS;
    const int n_rows = left < ROWS ? left : ROWS;
    const DecodeRows rows{s, num_heads, head0};
    // Index checks: a bad length or block-table entry of this partition is never read.
    const int raw_len = seq_lens[s];
    const bool bad_len = raw_len < 0 || raw_len > limit;
    const int seq_len = bad_len ? 0 : raw_len;  // in [0, limit] from here on
    const int t0 = part * partition_size;
    // One partition covers the whole sequence.
    const int t1 = max_partitions == 1 || seq_len - t0 < partition_size ? seq_len : t0 + partition_size;
    const int* table = block_tables + (hal_i64)s * max_blocks_per_seq;
    const int code = check_indices(0, 0, false, bad_len, table, t0, t1, block_size, num_blocks, error_flag);
    if (code != 0 || (max_partitions == 1 && seq_len <= 0)) {  // an empty or unreadable sequence gives zeros
        refuse(out, max_logits, exp_sums, rows, n_rows, code != 0 ? max_partitions : 1, part);
        return;
    }
    if (t0 >= seq_len) return;
    const hal_i64 qrow[2] = {row_of(rows, g), row_of(rows, g + 8)};
    const DecodeMask mask{scale * LOG2E, 0};
    const Keys keys{key_cache, value_cache, table, block_size, (hal_i64)num_kv_heads * block_size * HS,
                    (hal_i64)kv_head * block_size * HS, HS};
    const float* row_sinks = 0;
#endif
    attend(sm, query, qrow, n_rows, keys, t0, t1, mask);
    store(sm, out, tmp_out, max_logits, exp_sums, row_sinks, num_heads, rows, n_rows, max_partitions, part);
}
