// Gated MLP activation out = act(gate) * up (hal-core's gated_activation).
//
// Defines: HAL_DTYPE (of every array), HAL_WARP_SIZE, optional
// HAL_NUM_THREADS (default 256).  float32 math, out rounded once.  See README.md.
//
// grid (num_tokens, column blocks, 1): CTA (t, b) takes columns
// [b * HAL_NUM_THREADS * HAL_EPV, ...) of row t, one 16-byte vector per thread
// when the pointers, row strides and row are 16-byte aligned, else HAL_EPV
// elements per thread one by one.  activation: 0 silu, 1 exact (erf) GELU,
// 2 tanh GELU, as the reference's formulas.
#include "hal_common.cuh"

#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 256
#endif

namespace gact {

HAL_DEVICE float act(float g, int activation) {
    if (activation == 1) return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    if (activation == 2) return 0.5f * g * (1.f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
    return g / (1.f + expf(-g));
}

HAL_DEVICE hal_vec16 pack16(const float* in) {
    hal_u32 w[4];
#if HAL_DTYPE == HAL_F32
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = hal_float_to_bits(in[i]);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (hal_u32)hal_from_float(in[2 * i]) | ((hal_u32)hal_from_float(in[2 * i + 1]) << 16);
#endif
    hal_vec16 v;
    v.x = w[0];
    v.y = w[1];
    v.z = w[2];
    v.w = w[3];
    return v;
}

}  // namespace gact

HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_gated_activation(void* HAL_RESTRICT out, const void* HAL_RESTRICT gate, const void* HAL_RESTRICT up,
                     hal_i64 gate_stride, hal_i64 up_stride, int intermediate_size, int activation) {
    const hal_i64 row = blockIdx.x;
    const int tid = threadIdx.x;
    const hal_t* g = static_cast<const hal_t*>(gate) + row * gate_stride;
    const hal_t* u = static_cast<const hal_t*>(up) + row * up_stride;
    hal_t* o = static_cast<hal_t*>(out) + row * (hal_i64)intermediate_size;
    const int c0 = blockIdx.y * (HAL_NUM_THREADS * HAL_EPV);
    const unsigned long long bits = (unsigned long long)g | (unsigned long long)u | (unsigned long long)o |
                                    ((unsigned long long)intermediate_size * sizeof(hal_t));
    if ((bits & 15) == 0) {
        const int c = c0 + tid * HAL_EPV;
        if (c >= intermediate_size) return;
        float gv[HAL_EPV], uv[HAL_EPV];
        hal_unpack16(hal_load16(g + c), gv);
        hal_unpack16(hal_load16(u + c), uv);
#pragma unroll
        for (int e = 0; e < HAL_EPV; ++e) gv[e] = gact::act(gv[e], activation) * uv[e];
        *reinterpret_cast<hal_vec16*>(o + c) = gact::pack16(gv);
        return;
    }
    for (int k = 0; k < HAL_EPV; ++k) {
        const int c = c0 + k * HAL_NUM_THREADS + tid;
        if (c < intermediate_size) o[c] = hal_from_float(gact::act(hal_to_float(g[c]), activation) * hal_to_float(u[c]));
    }
}
