// Warp-level matrix instructions (sm_80+): mma.sync, ldmatrix, cp.async, and
// the packed 16-bit arithmetic of the int4 conversion, in PTX.  Kernels
// that include this file are built only where the prelude defines HAL_MMA_SYNC (min_sm); the
// host-compiled tests get the same functions from the host prelude's
// emulation (tests/host_compiled/mma_host.cuh), which documents the fragment
// layouts.  Operands are raw 32-bit registers: two 16-bit or four 8-bit
// elements each, the lower bits holding the element of lower index.
#pragma once
#ifndef HAL_PRELUDE
#error "prepend a vendor prelude before hal_mma.cuh"
#endif

#if defined(HAL_MMA_SYNC)

// d[4] = a[4] * b[2] + c[4]: A 16x16 row-major, B 16x8 column-major, f32 accumulate.
HAL_DEVICE void hal_mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
HAL_DEVICE void hal_mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
// d[4] = a[2] * b[1] + c[4]: A 16x8 row-major, B 8x8 column-major, f32 accumulate (the k = 8 shape).
HAL_DEVICE void hal_mma_m16n8k8_f16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
HAL_DEVICE void hal_mma_m16n8k8_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
// d[4] = a[4] * b[2] + c[4]: A 16x32 s8 row-major, B 32x8 s8 column-major, s32 accumulate.
HAL_DEVICE void hal_mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b, const int* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]),
          "r"(c[3]));
}

HAL_DEVICE unsigned hal_smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// ldmatrix: lanes 8j..8j+7 supply the row addresses (16 bytes each) of matrix j.
HAL_DEVICE void hal_ldmatrix_x1(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(hal_smem_address(p)));
}
HAL_DEVICE void hal_ldmatrix_x2(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(hal_smem_address(p)));
}
HAL_DEVICE void hal_ldmatrix_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(hal_smem_address(p)));
}
HAL_DEVICE void hal_ldmatrix_x1_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                 : "=r"(r[0])
                 : "r"(hal_smem_address(p)));
}
HAL_DEVICE void hal_ldmatrix_x2_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(hal_smem_address(p)));
}
HAL_DEVICE void hal_ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(hal_smem_address(p)));
}

// cp.async global -> shared; the bytes past src_bytes are zero-filled.
template <int BYTES>
HAL_DEVICE void hal_cp_async_ca(void* dst, const void* src, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(hal_smem_address(dst)), "l"(src),
                 "n"(BYTES), "r"(src_bytes)
                 : "memory");
}
HAL_DEVICE void hal_cp_async_cg16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(hal_smem_address(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
HAL_DEVICE void hal_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
HAL_DEVICE void hal_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
HAL_DEVICE void hal_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

HAL_DEVICE unsigned hal_pack_b16(unsigned short lo, unsigned short hi) { return lo | ((unsigned)hi << 16); }
HAL_DEVICE unsigned hal_fma_f16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
HAL_DEVICE unsigned hal_fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
HAL_DEVICE unsigned hal_sub_f16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// (a & b) | c in one LOP3.
HAL_DEVICE unsigned hal_and_or(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#elif !defined(HAL_HOST)
#error "hal_mma.cuh: the prelude provides no warp matrix instructions (HAL_MMA_SYNC); the host prelude emulates them"
#endif
