// RMSNorm of each row, with an optional fused residual add (hal-core's rms_norm).
//
// Defines: HAL_DTYPE (of every array), HAL_WARP_SIZE, optional
// HAL_NUM_THREADS (default 256).  One CTA per row; float32 math.  See README.md.
//
// Pass 1 reads x (and residual: h = x + residual is rounded to the dtype and
// written back) and sums h^2 per thread; warp shuffles then the CTA's warps, in
// a fixed order, give the row's sum.  Pass 2 reads h again (each thread the
// elements it wrote) and writes out = h * rsqrt(mean + epsilon) * (weight_offset
// + weight).  16-byte loads and stores when every pointer, the row strides and
// the row are 16-byte aligned, else one element per thread and step.
// residual is read with plain loads (never the read-only path: the kernel writes it).
#include "hal_common.cuh"

#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 256
#endif

namespace rmsn {

constexpr int kWarps = HAL_NUM_THREADS / HAL_WARP_SIZE;

// HAL_EPV floats to one 16-byte vector of HAL_DTYPE elements (hal_unpack16's inverse).
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

// A float as the dtype stores it.
HAL_DEVICE float rounded(float v) { return hal_to_float(hal_from_float(v)); }

// The sum of v over the CTA (every thread gets it): warp shuffles, then warp 0's lanes in order.
HAL_DEVICE float cta_sum(float v) {
    __shared__ float s_part[kWarps];
    __shared__ float s_total;
    v = hal_warp_sum(v);
    const int tid = threadIdx.x;
    if (tid % HAL_WARP_SIZE == 0) s_part[tid / HAL_WARP_SIZE] = v;
    hal_barrier();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < kWarps; ++w) t += s_part[w];
        s_total = t;
    }
    hal_barrier();
    return s_total;
}

}  // namespace rmsn

// grid (num_tokens, 1, 1), block (HAL_NUM_THREADS, 1, 1).  out is contiguous; x and residual rows are
// x_stride / residual_stride elements apart; residual may be null (0).
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_rms_norm(void* HAL_RESTRICT out, const void* HAL_RESTRICT x, const void* HAL_RESTRICT weight,
             void* HAL_RESTRICT residual, hal_i64 x_stride, hal_i64 residual_stride, int hidden_size,
             float epsilon, float weight_offset) {
    const hal_i64 row = blockIdx.x;
    const int tid = threadIdx.x;
    const hal_t* xr = static_cast<const hal_t*>(x) + row * x_stride;
    hal_t* rr = residual != 0 ? static_cast<hal_t*>(residual) + row * residual_stride : 0;
    const hal_t* w = static_cast<const hal_t*>(weight);
    hal_t* o = static_cast<hal_t*>(out) + row * (hal_i64)hidden_size;
    const unsigned long long bits = (unsigned long long)xr | (unsigned long long)rr | (unsigned long long)w |
                                    (unsigned long long)o | ((unsigned long long)hidden_size * sizeof(hal_t));
    const bool vec = (bits & 15) == 0;
    const int nvec = hidden_size / HAL_EPV;

    float ss = 0.f;
    if (vec) {
        for (int v = tid; v < nvec; v += HAL_NUM_THREADS) {
            float h[HAL_EPV];
            hal_unpack16(hal_load16(xr + v * HAL_EPV), h);
            if (rr != 0) {
                hal_vec16* rv = reinterpret_cast<hal_vec16*>(rr + v * HAL_EPV);
                float r[HAL_EPV];
                hal_unpack16(*rv, r);
#pragma unroll
                for (int e = 0; e < HAL_EPV; ++e) h[e] = rmsn::rounded(h[e] + r[e]);
                *rv = rmsn::pack16(h);
            }
#pragma unroll
            for (int e = 0; e < HAL_EPV; ++e) ss += h[e] * h[e];
        }
    } else {
        for (int i = tid; i < hidden_size; i += HAL_NUM_THREADS) {
            float h = hal_to_float(xr[i]);
            if (rr != 0) {
                h = rmsn::rounded(h + hal_to_float(rr[i]));
                rr[i] = hal_from_float(h);
            }
            ss += h * h;
        }
    }
    const float scale = 1.f / sqrtf(rmsn::cta_sum(ss) / (float)hidden_size + epsilon);

    if (vec) {
        for (int v = tid; v < nvec; v += HAL_NUM_THREADS) {
            float h[HAL_EPV], g[HAL_EPV];
            hal_unpack16(rr != 0 ? *reinterpret_cast<const hal_vec16*>(rr + v * HAL_EPV)
                                 : hal_load16(xr + v * HAL_EPV), h);
            hal_unpack16(hal_load16(w + v * HAL_EPV), g);
#pragma unroll
            for (int e = 0; e < HAL_EPV; ++e) h[e] = h[e] * scale * (g[e] + weight_offset);
            *reinterpret_cast<hal_vec16*>(o + v * HAL_EPV) = rmsn::pack16(h);
        }
    } else {
        for (int i = tid; i < hidden_size; i += HAL_NUM_THREADS) {
            const float h = hal_to_float(rr != 0 ? rr[i] : xr[i]);
            o[i] = hal_from_float(h * scale * (hal_to_float(w[i]) + weight_offset));
        }
    }
}
