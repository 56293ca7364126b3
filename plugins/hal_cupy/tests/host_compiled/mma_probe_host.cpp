// Probes of the warp matrix emulation (mma_host.cuh), for the layout tests:
// each lane loads its registers from per-lane arrays, runs one instruction and
// stores what it received, so the tests can compare every lane's fragment
// with the PTX ISA's layout tables.
#include "prelude_host.cuh"

namespace {
constexpr unsigned kWarps = 2;  // two warps: each must see only its own lanes
const unsigned kGrid[3] = {1, 1, 1};
const unsigned kBlock[3] = {kWarps * 32, 1, 1};
}  // namespace

// d[t][4] = mma(a[t][4], b[t][2], c[t][4]) for every thread t (warp w uses its own 32 lanes).
extern "C" int probe_mma_m16n8k16(const unsigned* a, const unsigned* b, const float* c, float* d, int bf16) {
    return hal_host::launch_lambda(kGrid, kBlock, [=] {
        const unsigned t = threadIdx.x;
        if (bf16)
            hal_mma_m16n8k16_bf16(d + 4 * t, a + 4 * t, b + 2 * t, c + 4 * t);
        else
            hal_mma_m16n8k16_f16(d + 4 * t, a + 4 * t, b + 2 * t, c + 4 * t);
    });
}

// d[t][4] = mma.m16n8k8(a[t][2], b[t][1], c[t][4]) for every thread t.
extern "C" int probe_mma_m16n8k8(const unsigned* a, const unsigned* b, const float* c, float* d, int bf16) {
    return hal_host::launch_lambda(kGrid, kBlock, [=] {
        const unsigned t = threadIdx.x;
        if (bf16)
            hal_mma_m16n8k8_bf16(d + 4 * t, a + 2 * t, b + t, c + 4 * t);
        else
            hal_mma_m16n8k8_f16(d + 4 * t, a + 2 * t, b + t, c + 4 * t);
    });
}

extern "C" int probe_mma_m16n8k32_s8(const unsigned* a, const unsigned* b, const int* c, int* d) {
    return hal_host::launch_lambda(kGrid, kBlock, [=] {
        const unsigned t = threadIdx.x;
        hal_mma_m16n8k32_s8(d + 4 * t, a + 4 * t, b + 2 * t, c + 4 * t);
    });
}

// r[t][4] = ldmatrix.x{count}[.trans] with row address base + offsets[t] (in 16-bit elements).
extern "C" int probe_ldmatrix(const unsigned short* base, const int* offsets, int count, int trans, unsigned* r) {
    return hal_host::launch_lambda(kGrid, kBlock, [=] {
        const unsigned t = threadIdx.x;
        const void* p = base + offsets[t];
        unsigned* out = r + 4 * t;
        if (count == 1) trans ? hal_ldmatrix_x1_trans(out, p) : hal_ldmatrix_x1(out, p);
        if (count == 2) trans ? hal_ldmatrix_x2_trans(out, p) : hal_ldmatrix_x2(out, p);
        if (count == 4) trans ? hal_ldmatrix_x4_trans(out, p) : hal_ldmatrix_x4(out, p);
    });
}

// One thread, three cp.async groups into dst (48 bytes, pre-filled by the caller)
// from src: group 0 = 16 bytes (cg) at 0, group 1 = 8 bytes (ca) at 16 plus 4
// bytes (ca) at 24, group 2 = 16 bytes (cg) at 32 with only src_bytes2 read
// (the rest zero-filled).  seen[4][48] records dst after issuing everything,
// after wait_group 2, after wait_group 1 and after wait_all.
extern "C" int probe_cp_async(const unsigned char* src, unsigned char* dst, int src_bytes2, unsigned char* seen) {
    const unsigned block[3] = {32, 1, 1};
    return hal_host::launch_lambda(kGrid, block, [=] {
        if (threadIdx.x != 0) return;
        hal_cp_async_cg16(dst, src, 16);
        hal_cp_async_commit();
        hal_cp_async_ca<8>(dst + 16, src + 16, 8);
        hal_cp_async_ca<4>(dst + 24, src + 24, 4);
        hal_cp_async_commit();
        hal_cp_async_cg16(dst + 32, src + 32, src_bytes2);
        hal_cp_async_commit();
        std::memcpy(seen, dst, 48);
        hal_cp_async_wait<2>();
        std::memcpy(seen + 48, dst, 48);
        hal_cp_async_wait<1>();
        std::memcpy(seen + 96, dst, 48);
        hal_cp_async_wait_all();
        std::memcpy(seen + 144, dst, 48);
    });
}

// A full tile product d[16][8] = a[16][16] @ b[16][8] + c[16][8] by one warp:
// a and b (row-major, 16-bit) are staged in shared memory with cp.async, A is
// read with ldmatrix.x4, B with ldmatrix.x2.trans, c and d are row-major f32.
extern "C" int probe_tile_product(const unsigned short* a, const unsigned short* b, const float* c, float* d,
                                  int bf16) {
    const unsigned block[3] = {32, 1, 1};
    return hal_host::launch_lambda(kGrid, block, [=] {
        __shared__ unsigned short s_a[16][16 + 8];  // padded rows, 16-byte aligned
        __shared__ unsigned short s_b[16][8];
        const int lane = threadIdx.x;
        // 16 rows x 32 bytes of A = 32 chunks; 16 rows x 16 bytes of B = 16 chunks.
        hal_cp_async_cg16(&s_a[lane / 2][8 * (lane % 2)], a + 16 * (lane / 2) + 8 * (lane % 2), 16);
        if (lane < 16) hal_cp_async_cg16(&s_b[lane][0], b + 8 * lane, 16);
        hal_cp_async_commit();
        hal_cp_async_wait_all();
        hal_barrier();
        unsigned af[4], bfr[2];
        hal_ldmatrix_x4(af, &s_a[lane % 16][8 * (lane / 16)]);
        hal_ldmatrix_x2_trans(bfr, &s_b[lane % 16][0]);
        const int g = lane >> 2, t = lane & 3;
        float cf[4], df[4];
        for (int i = 0; i < 4; ++i) cf[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
        if (bf16)
            hal_mma_m16n8k16_bf16(df, af, bfr, cf);
        else
            hal_mma_m16n8k16_f16(df, af, bfr, cf);
        for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = df[i];
    });
}

// r[i] = f(a[i], b[i], c[i]) for op 0: fma.f16x2, 1: fma.bf16x2, 2: sub.f16x2 (c unused), 3: (a & b) | c.
extern "C" void probe_b16x2(int op, const unsigned* a, const unsigned* b, const unsigned* c, unsigned* r, int n) {
    for (int i = 0; i < n; ++i) {
        switch (op) {
            case 0: r[i] = hal_fma_f16x2(a[i], b[i], c[i]); break;
            case 1: r[i] = hal_fma_bf16x2(a[i], b[i], c[i]); break;
            case 2: r[i] = hal_sub_f16x2(a[i], b[i]); break;
            default: r[i] = hal_and_or(a[i], b[i], c[i]); break;
        }
    }
}
