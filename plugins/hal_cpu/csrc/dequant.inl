// dequant.inl: included by kernels.cpp inside namespace hal::<variant>; not a standalone header.
// ---------------------------------------------------------------------------------------------
// Dequantised tiles (fed to BLAS for large M, and for act-order int4 weights)
// ---------------------------------------------------------------------------------------------

template <class SS>
void dequant_t(const hal_cpu_dequant_tile_args &a) {
    const void *qweight = a.qweight;
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const uint8_t *zeros = a.zeros;
    const int32_t *g_idx = a.g_idx;
    const int32_t bits = a.bits, zdef = a.default_zero, threads = a.threads;
    const int64_t gsize = a.group_size, k = a.k, n = a.n, n0 = a.n0, n1 = a.n1, ld = a.ld;
    float *out = a.out;
    const int64_t width = n1 - n0;
    const int64_t rows_per_task = 64;
    parallel_for((k + rows_per_task - 1) / rows_per_task, threads, [&](int64_t t) {
        const int64_t r1 = std::min(k, (t + 1) * rows_per_task);
        for (int64_t r = t * rows_per_task; r < r1; ++r) {
            const int64_t g = g_idx ? g_idx[r] : r / gsize;
            const typename SS::T *srow = scales + g * n + n0;
            const uint8_t *zrow = zeros ? zeros + g * n + n0 : nullptr;
            float *o = out + r * ld;
            const V::f zd = V::set1(float(zdef));
            int64_t c = 0;
            if (bits == 4) {
                const uint32_t *wrow = static_cast<const uint32_t *>(qweight) + (r / 8) * n + n0;
                const int shift = int(4 * (r % 8));
                const V::i mask = V::seti(0xFu);
                for (; c + W <= width; c += W) {
                    V::i w = V::loadi(wrow + c);
                    V::i q;
                    switch (shift) {  // immediate shifts
                        case 0: q = w; break;
                        case 4: q = V::srli<4>(w); break;
                        case 8: q = V::srli<8>(w); break;
                        case 12: q = V::srli<12>(w); break;
                        case 16: q = V::srli<16>(w); break;
                        case 20: q = V::srli<20>(w); break;
                        case 24: q = V::srli<24>(w); break;
                        default: q = V::srli<28>(w); break;
                    }
                    const V::f z = zrow ? V::load_u8(zrow + c) : zd;
                    V::store(o + c, V::mul(V::sub(V::cvt(V::andi(q, mask)), z), vload<SS>(srow + c)));
                }
                for (; c < width; ++c) {
                    const float q = float((wrow[c] >> shift) & 0xFu);
                    o[c] = (q - (zrow ? float(zrow[c]) : float(zdef))) * SS::scalar(srow + c);
                }
            } else {
                const uint8_t *wrow = static_cast<const uint8_t *>(qweight) + r * n + n0;
                for (; c + W <= width; c += W) {
                    const V::f z = zrow ? V::load_u8(zrow + c) : zd;
                    V::store(o + c, V::mul(V::sub(V::load_u8(wrow + c), z), vload<SS>(srow + c)));
                }
                for (; c < width; ++c)
                    o[c] = (float(wrow[c]) - (zrow ? float(zrow[c]) : float(zdef))) * SS::scalar(srow + c);
            }
        }
    });
}

int dequant_tile(const hal_cpu_dequant_tile_args *args) {
    if (args->s_dtype == HAL_F16) dequant_t<F16>(*args);
    else if (args->s_dtype == HAL_BF16) dequant_t<BF16>(*args);
    else dequant_t<F32>(*args);
    return HAL_OK;
}
