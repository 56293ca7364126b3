// Host emulation of the warp-level matrix instructions of hal_mma.cuh
// (included by prelude_host.cuh; needs 32-lane warps).
//
// Every function is warp-collective, as on the GPU: each lane publishes its
// operands (registers, or the row address it supplies), the warp meets at a
// warp barrier, and each lane then computes its own results from every lane's
// operands, following the fragment layouts of the PTX ISA (sections "Matrix
// Fragments for mma.m16n8k16 with floating point type", "... for
// mma.m16n8k32" and "ldmatrix"):
//   groupID = lane >> 2, threadID_in_group = lane % 4
//   m16n8k16 .f16/.bf16  A (16x16, row): reg i in 0..3 holds (row, col) pairs
//       row = groupID + 8 * (i & 1), col = 2 * threadID_in_group + 8 * (i >> 1) + {0, 1}
//     B (16x8, col): reg i in 0..1: row (k) = 2 * threadID_in_group + 8 * i + {0, 1}, col = groupID
//     C/D (16x8 f32): elem i in 0..3: row = groupID + 8 * (i >> 1), col = 2 * threadID_in_group + (i & 1)
//   m16n8k8 .f16/.bf16  A (16x8): reg i in 0..1: row = groupID + 8 * i, col = 2 * threadID_in_group + {0, 1}
//     B (8x8): reg 0: row (k) = 2 * threadID_in_group + {0, 1}, col = groupID;  C/D as for m16n8k16
//     (these are the k < 8 halves of the m16n8k16 fragments: the emulation runs m16n8k16 with the rest zero)
//   m16n8k32 .s8  A (16x32): reg i holds 4 bytes: row = groupID + 8 * (i & 1),
//       col = 4 * threadID_in_group + 16 * (i >> 1) + {0..3}
//     B (32x8): reg i: row (k) = 4 * threadID_in_group + 16 * i + {0..3}, col = groupID
//     C/D (16x8 s32): as for f32.
// The lower 16 (8) bits of a register hold the element of lower column (row)
// index.  Products are exact; each D element is C + the sum of its 16 (32)
// products, computed in float64 and rounded once to float32 (the hardware
// adds with at least float32 precision in an order it does not specify, so
// hardware and emulation agree to float32 rounding of partial sums).  Integer
// MMA is exact, wrapping modulo 2^32 as .s32 does.
//
// cp.async: copies are queued per thread and performed when a later
// cp.async.wait_group (or wait_all) retires their group, in issue order -- the
// latest moment the hardware may complete them -- so a kernel that reads its
// destination before waiting, or another thread's destination before the
// barrier that follows the wait, reads stale data and fails its test.
#pragma once
#include <deque>

namespace hal_host {

struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes, src_bytes;
};
struct AsyncQueue {
    unsigned long long cta = 0;                // rt.cta_serial the queue belongs to
    std::vector<AsyncCopy> open;               // issued, not yet committed
    std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};
static std::vector<AsyncQueue> async_queues;  // per thread of the running CTA

// Queues left by a previous CTA (a kernel that never waited) are dropped, as
// the hardware discards a finished CTA's shared memory.
static inline AsyncQueue& async_queue() {
    if (async_queues.size() < kMaxThreads) async_queues.resize(kMaxThreads);
    AsyncQueue& q = async_queues[threadIdx.x];
    if (q.cta != rt.cta_serial) {
        q.open.clear();
        q.groups.clear();
        q.cta = rt.cta_serial;
    }
    return q;
}
static inline void perform(const AsyncCopy& c) {
    unsigned char tmp[16];
    std::memset(tmp, 0, sizeof tmp);
    if (c.src_bytes) std::memcpy(tmp, c.src, c.src_bytes);
    std::memcpy(c.dst, tmp, c.bytes);
}
// Warp-collective exchange of up to 10 words per lane, double-buffered by the
// warp barrier's generation (as exchange_lanes).
constexpr int kWords = 10;
static unsigned mma_words[2][kMaxThreads][kWords];
static const void* row_addresses[2][kMaxThreads];

static inline const unsigned (*publish(const unsigned* w, int n))[kWords] {
    const unsigned tid = threadIdx.x, warp = tid / HAL_WARP_SIZE;
    Barrier& b = rt.warps[warp];
    const unsigned parity = b.generation & 1;
    for (int i = 0; i < n; ++i) mma_words[parity][tid][i] = w[i];
    wait(b);
    return &mma_words[parity][warp * HAL_WARP_SIZE];
}
static inline const void* const* publish_address(const void* p) {
    const unsigned tid = threadIdx.x, warp = tid / HAL_WARP_SIZE;
    Barrier& b = rt.warps[warp];
    const unsigned parity = b.generation & 1;
    row_addresses[parity][tid] = p;
    wait(b);
    return &row_addresses[parity][warp * HAL_WARP_SIZE];
}

static inline double b16_value(unsigned short h, bool bf16) {
    if (bf16) {
        const unsigned u = (unsigned)h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (double)(float)x;
}
static inline unsigned short half_of(unsigned reg, int which) {
    return (unsigned short)(which ? reg >> 16 : reg & 0xffffu);
}

// d = a * b + c for one m16n8k16 with 16-bit inputs; words: a[4] b[2] c[4].
static inline void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const float* c, bool bf16) {
    unsigned w[kWords];
    for (int i = 0; i < 4; ++i) w[i] = a[i];
    for (int i = 0; i < 2; ++i) w[4 + i] = b[i];
    for (int i = 0; i < 4; ++i) std::memcpy(&w[6 + i], &c[i], 4);
    const unsigned (*all)[kWords] = publish(w, kWords);
    const int lane = threadIdx.x % HAL_WARP_SIZE, group = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = group + 8 * (i >> 1), col = 2 * tig + (i & 1);
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) {
            const int a_lane = (row % 8) * 4 + (k % 8) / 2, a_reg = (row / 8) + 2 * (k / 8);
            const int b_lane = col * 4 + (k % 8) / 2, b_reg = k / 8;
            sum += b16_value(half_of(all[a_lane][a_reg], k & 1), bf16) *
                   b16_value(half_of(all[b_lane][4 + b_reg], k & 1), bf16);
        }
        const int c_lane = (row % 8) * 4 + col / 2, c_elem = (col & 1) + 2 * (row / 8);
        float cv;
        std::memcpy(&cv, &all[c_lane][6 + c_elem], 4);
        d[i] = (float)(sum + (double)cv);
    }
}

// d = a * b + c for one m16n8k8 with 16-bit inputs: a[2] b[1] are m16n8k16's registers a0, a1, b0.
static inline void mma_m16n8k8(float* d, const unsigned* a, const unsigned* b, const float* c, bool bf16) {
    const unsigned a16[4] = {a[0], a[1], 0u, 0u}, b16[2] = {b[0], 0u};
    mma_m16n8k16(d, a16, b16, c, bf16);
}

// d = a * b + c for one m16n8k32 with signed 8-bit inputs; words: a[4] b[2] c[4].
static inline void mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b, const int* c) {
    unsigned w[kWords];
    for (int i = 0; i < 4; ++i) w[i] = a[i];
    for (int i = 0; i < 2; ++i) w[4 + i] = b[i];
    for (int i = 0; i < 4; ++i) w[6 + i] = (unsigned)c[i];
    const unsigned (*all)[kWords] = publish(w, kWords);
    const int lane = threadIdx.x % HAL_WARP_SIZE, group = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = group + 8 * (i >> 1), col = 2 * tig + (i & 1);
        const int c_lane = (row % 8) * 4 + col / 2, c_elem = (col & 1) + 2 * (row / 8);
        unsigned acc = all[c_lane][6 + c_elem];
        for (int k = 0; k < 32; ++k) {
            const int a_lane = (row % 8) * 4 + (k % 16) / 4, a_reg = (row / 8) + 2 * (k / 16);
            const int b_lane = col * 4 + (k % 16) / 4, b_reg = k / 16;
            const int av = (signed char)((all[a_lane][a_reg] >> (8 * (k % 4))) & 0xffu);
            const int bv = (signed char)((all[b_lane][4 + b_reg] >> (8 * (k % 4))) & 0xffu);
            acc += (unsigned)(av * bv);
        }
        d[i] = (int)acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x{count}[.trans].shared.b16: lanes 8j..8j+7 give
// the row addresses of matrix j; lane l receives, of matrix j, row l/4,
// columns 2(l%4) and 2(l%4)+1 (transposed: column l/4, rows 2(l%4), 2(l%4)+1).
static inline void ldmatrix(unsigned* r, int count, bool trans, const void* row_address) {
    const void* const* rows = publish_address(row_address);
    const int lane = threadIdx.x % HAL_WARP_SIZE;
    for (int j = 0; j < count; ++j) {
        unsigned short e[2];
        for (int h = 0; h < 2; ++h) {
            const int row = trans ? 2 * (lane % 4) + h : lane / 4;
            const int col = trans ? lane / 4 : 2 * (lane % 4) + h;
            std::memcpy(&e[h], static_cast<const unsigned char*>(rows[8 * j + row]) + 2 * col, 2);
        }
        r[j] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
}

static inline void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
    async_queue().open.push_back(AsyncCopy{dst, src, bytes, src_bytes < bytes ? src_bytes : bytes});
}
static inline void cp_async_commit() {
    AsyncQueue& q = async_queue();
    q.groups.push_back(std::move(q.open));
    q.open.clear();
}
static inline void cp_async_wait(unsigned pending) {
    AsyncQueue& q = async_queue();
    while (q.groups.size() > pending) {
        for (const AsyncCopy& c : q.groups.front()) perform(c);
        q.groups.pop_front();
    }
}

}  // namespace hal_host

// The spellings of hal_mma.cuh.
HAL_DEVICE void hal_mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    hal_host::mma_m16n8k16(d, a, b, c, false);
}
HAL_DEVICE void hal_mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    hal_host::mma_m16n8k16(d, a, b, c, true);
}
HAL_DEVICE void hal_mma_m16n8k8_f16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    hal_host::mma_m16n8k8(d, a, b, c, false);
}
HAL_DEVICE void hal_mma_m16n8k8_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    hal_host::mma_m16n8k8(d, a, b, c, true);
}
HAL_DEVICE void hal_mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b, const int* c) {
    hal_host::mma_m16n8k32_s8(d, a, b, c);
}
HAL_DEVICE void hal_ldmatrix_x1(unsigned* r, const void* p) { hal_host::ldmatrix(r, 1, false, p); }
HAL_DEVICE void hal_ldmatrix_x2(unsigned* r, const void* p) { hal_host::ldmatrix(r, 2, false, p); }
HAL_DEVICE void hal_ldmatrix_x4(unsigned* r, const void* p) { hal_host::ldmatrix(r, 4, false, p); }
HAL_DEVICE void hal_ldmatrix_x1_trans(unsigned* r, const void* p) { hal_host::ldmatrix(r, 1, true, p); }
HAL_DEVICE void hal_ldmatrix_x2_trans(unsigned* r, const void* p) { hal_host::ldmatrix(r, 2, true, p); }
HAL_DEVICE void hal_ldmatrix_x4_trans(unsigned* r, const void* p) { hal_host::ldmatrix(r, 4, true, p); }
// cp.async.ca (4, 8 or 16 bytes) and cp.async.cg (16 bytes); src_bytes < bytes zero-fills the rest.
template <int BYTES>
HAL_DEVICE void hal_cp_async_ca(void* dst, const void* src, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
    hal_host::cp_async(dst, src, BYTES, (unsigned)src_bytes);
}
HAL_DEVICE void hal_cp_async_cg16(void* dst, const void* src, int src_bytes) {
    hal_host::cp_async(dst, src, 16, (unsigned)src_bytes);
}
HAL_DEVICE void hal_cp_async_commit() { hal_host::cp_async_commit(); }
template <int N>
HAL_DEVICE void hal_cp_async_wait() {
    hal_host::cp_async_wait(N);
}
HAL_DEVICE void hal_cp_async_wait_all() { hal_host::cp_async_wait(0); }

// Packed 16-bit pair arithmetic used by the int4 conversion (f16x2 / bf16x2,
// round to nearest even; one rounding from the exact result).
HAL_DEVICE unsigned hal_pack_b16(unsigned short lo, unsigned short hi) { return lo | ((unsigned)hi << 16); }
HAL_DEVICE unsigned short hal_host_round_b16(double v, bool bf16) {
    if (!bf16) {
        const _Float16 x = (_Float16)v;
        unsigned short h;
        std::memcpy(&h, &x, 2);
        return h;
    }
    const float f = (float)v;  // exact for the values the conversion produces
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
// a * b + c per 16-bit lane of the pair.
HAL_DEVICE unsigned hal_host_fma_b16x2(unsigned a, unsigned b, unsigned c, bool bf16) {
    unsigned short r[2];
    for (int h = 0; h < 2; ++h) {
        const double v = hal_host::b16_value(hal_host::half_of(a, h), bf16) *
                             hal_host::b16_value(hal_host::half_of(b, h), bf16) +
                         hal_host::b16_value(hal_host::half_of(c, h), bf16);
        r[h] = hal_host_round_b16(v, bf16);
    }
    return hal_pack_b16(r[0], r[1]);
}
HAL_DEVICE unsigned hal_fma_f16x2(unsigned a, unsigned b, unsigned c) {
    return hal_host_fma_b16x2(a, b, c, false);
}
HAL_DEVICE unsigned hal_fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    return hal_host_fma_b16x2(a, b, c, true);
}
HAL_DEVICE unsigned hal_sub_f16x2(unsigned a, unsigned b) {
    unsigned short r[2];
    for (int h = 0; h < 2; ++h)
        r[h] = hal_host_round_b16(hal_host::b16_value(hal_host::half_of(a, h), false) -
                                      hal_host::b16_value(hal_host::half_of(b, h), false),
                                  false);
    return hal_pack_b16(r[0], r[1]);
}
// (a & b) | c, one LOP3 on the GPU.
HAL_DEVICE unsigned hal_and_or(unsigned a, unsigned b, unsigned c) { return (a & b) | c; }
