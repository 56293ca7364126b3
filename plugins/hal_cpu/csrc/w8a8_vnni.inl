// w8a8_vnni.inl: included by w8a8.inl in the avx512vnni variant only (VI, isa.h); not a standalone header.
// ---------------------------------------------------------------------------------------------
// W8A8 with byte dot products: int8 activations x uint8 codes summed exactly in int32
// ---------------------------------------------------------------------------------------------
//
// vpdpbusd multiplies 4 consecutive unsigned bytes (codes of 4 consecutive K rows) with 4 signed
// bytes (the token's quantised activations) and adds the 4 products to an int32 lane. Segments are
// the fp32 kernel's (at most kExactRows rows of one group), so every int32 sum is an integer of
// magnitude below 255 * 127 * 512 < 2**24: it cannot overflow int32 (which would need 66,000 rows)
// and converts to float exactly. The float epilogue then runs the very operations of the fp32
// kernel in the same order, fma(s, sum - z * sum(xq), total) segment after segment, so both
// kernels give the same bits.
//
// Activations are quantised once per call into an int8 panel [M, Kp]: each segment's rows (in the
// permuted order for act-order weights) zero-padded to a multiple of 4, so a 4-row step never
// crosses a segment; padding rows multiply a real (readable) code row by zero.
//   M <= kVnniGemvRows: the codes are read straight from [K, N]; each step reads 8 rows across a wide
//     column tile (contiguous bytes), interleaves them in registers and accumulates into an int32
//     [M, tile] workspace in L1 (columns in a lane-blocked order, put back per segment).
//   larger M (from 32 rows on AMX-INT8, w8a8_amx.inl, with the same panels and epilogue): a task owns a block of
//     up to 32 panels of 64 columns (the blocks spread evenly over a
//     multiple of the thread count) and walks K in chunks of whole segments (one group of 128 rows):
//     it packs the chunk's codes into dot-product layout ([rows / 4, 64, 4] bytes per panel, natural
//     column order) in a per-task workspace of at most 320 KiB, reading 4 code rows at a time as runs
//     of up to 2 KiB, then 6 x 64 register tiles run over each panel (24 int32 accumulators, 4 code
//     vectors and one broadcast per step of 4 rows). Segments are still summed and folded into y
//     one after the other, so the bits do not change with the chunks or the blocks.

constexpr int64_t kVnniGemvRows = 4;
constexpr int kVnniTileRows = 6;
constexpr int64_t kVnniAccWords = 8192;     // int32 accumulators of a small-M task (32 KiB of stack): M x tile
                                            // at most, so up to 8192 columns for M = 1 and 2048 for M = 4
constexpr int64_t kVnniPrefetchRows = 32;  // code rows read this far ahead are prefetched into L2
//: Larger M: code rows packed per chunk of K (whole segments, one group of 128 rows), and 64-column panels per
//: task: up to 32 (each packing step reads 4 code rows as runs of up to 2 KiB), within kVnniPackBytes (L2).
constexpr int64_t kVnniBlockPanels = 32;
constexpr int64_t kVnniChunkRows = 128;
constexpr int64_t kVnniPackBytes = 320 * 1024;

struct W8Panel {
    int64_t kp = 0;              // padded row length of q (a multiple of 4)
    std::vector<int64_t> pstart; // [nseg + 1] padded offset of each segment
    std::vector<int8_t> q;       // [m, kp] quantised activations
    std::vector<float> sum;      // [m, nseg] exact integer sums of q over each segment
    std::vector<float> sx;       // [m] the token scale, NaN for a row holding NaN or Inf
};

// Quantise rows of x bit for bit as hal_core.quant.quantize_activations, into the padded panel.
inline void w8_quantise(const void *x, int32_t xdt, int64_t xstride, int64_t m, int64_t k, const int32_t *perm,
                        const std::vector<Segment> &segs, W8Panel &p, int32_t threads) {
    const int64_t nseg = int64_t(segs.size());
    p.pstart.assign(size_t(nseg) + 1, 0);
    for (int64_t s = 0; s < nseg; ++s) p.pstart[s + 1] = p.pstart[s] + (segs[s].end - segs[s].start + 3) / 4 * 4;
    p.kp = std::max<int64_t>(p.pstart[nseg], 4);
    p.q.assign(size_t(m) * p.kp, 0);
    p.sum.assign(size_t(m) * std::max<int64_t>(nseg, 1), 0.0f);
    p.sx.assign(size_t(m), 0.0f);
    const int64_t per_task = 8, tasks = (m + per_task - 1) / per_task;
    TaskSlots slots(std::min<int64_t>(tasks, std::max<int32_t>(threads, 1)));
    const size_t width = size_t(k) + W;
    std::vector<float> rows(size_t(slots.count()) * width);
    std::vector<int8_t> codes(size_t(slots.count()) * width);
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t slot = slots.acquire();
        float *row = rows.data() + size_t(slot) * width;
        int8_t *q8 = codes.data() + size_t(slot) * width;
        for (int64_t r = t * per_task; r < std::min(m, (t + 1) * per_task); ++r) {
            any_row_to_f32(row_ptr(x, xdt, r, xstride), xdt, k, row);
            V::f vmax = V::zero();
            __mmask16 nonfinite = 0;
            int64_t i = 0;
            for (; i + W <= k; i += W) {
                const V::f v = V::load(row + i);
                nonfinite |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN, SNaN, +Inf, -Inf
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
            }
            float amax = _mm512_reduce_max_ps(vmax);
            bool finite = nonfinite == 0;
            for (; i < k; ++i) {
                finite &= std::isfinite(row[i]);
                amax = std::max(amax, std::fabs(row[i]));
            }
            int8_t *dst = p.q.data() + r * p.kp;
            if (!finite) {
                p.sx[r] = kNaN;  // q and the sums stay zero: the row's outputs are 0 * NaN
                continue;
            }
            const float s = amax > 0.0f ? std::max(amax / 127.0f, std::numeric_limits<float>::denorm_min()) : 1.0f;
            p.sx[r] = s;
            const V::f vs = V::set1(s), lo = V::set1(-127.0f), hi = V::set1(127.0f);
            for (i = 0; i + W <= k; i += W) {
                V::f v = _mm512_roundscale_ps(_mm512_div_ps(V::load(row + i), vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
                _mm_storeu_si128(reinterpret_cast<__m128i *>(q8 + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
            }
            for (; i < k; ++i) q8[i] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(row[i] / s))));
            for (int64_t sg = 0; sg < nseg; ++sg) {
                int8_t *d = dst + p.pstart[sg];
                const int64_t a = segs[sg].start, len = segs[sg].end - a;
                if (perm)
                    for (int64_t j = 0; j < len; ++j) d[j] = q8[perm[a + j]];
                else
                    std::memcpy(d, q8 + a, size_t(len));
                int32_t total = 0;
                for (int64_t j = 0; j < len; ++j) total += d[j];
                p.sum[r * nseg + sg] = float(total);
            }
        }
        slots.release(slot);
    });
}

inline __mmask16 w8_lanes(int64_t valid) {
    return valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

template <class SS>
inline V::f w8_load_scales(const typename SS::T *p, __mmask16 mask);
template <>
inline V::f w8_load_scales<F32>(const float *p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
template <>
inline V::f w8_load_scales<F16>(const uint16_t *p, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}
template <>
inline V::f w8_load_scales<BF16>(const uint16_t *p, __mmask16 mask) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// What the epilogue of one segment needs: the weight's group scales and zero points.
template <class SS>
struct W8Weight {
    const uint8_t *qw;
    int64_t n;
    const int32_t *perm;
    const typename SS::T *scales;
    const uint8_t *zeros;
    float zdef;

    const uint8_t *row(int64_t i) const { return qw + (perm ? int64_t(perm[i]) : i) * n; }
    V::f scale(int32_t g, int64_t col, __mmask16 mask) const { return w8_load_scales<SS>(scales + g * n + col, mask); }
    V::f zero(int32_t g, int64_t col, __mmask16 mask) const {
        if (!zeros) return V::set1(zdef);
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, zeros + g * n + col)));
    }
};

// total (y, `first` = no earlier segment) = fma(s, acc - z * sum, total) for 16 columns at y.
inline void w8_accumulate(VI::i acc, V::f s, V::f z, float sum, bool first, float *y, __mmask16 mask) {
    const V::f d = V::fnma(z, V::set1(sum), _mm512_cvtepi32_ps(acc));
    const V::f prev = first ? V::zero() : _mm512_maskz_loadu_ps(mask, y);
    _mm512_mask_storeu_ps(y, mask, V::fma(s, d, prev));
}

// One step of 4 code rows r0..r3 (64 columns, `valid` of them real) for MB token rows (broadcast
// activations b), into int32 accumulators in memory (acc + mb * lda: 4 vectors in lane-blocked column
// order, vector v's 128-bit block L holding columns 16L + 4v .. 16L + 4v + 3).
template <int MB, bool FULL>
inline void w8v_step(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2, const uint8_t *r3, int64_t valid,
                     const VI::i (&b)[MB], int32_t *acc, int64_t lda) {
    const VI::i w0 = FULL ? _mm512_loadu_si512(r0) : VI::load_bytes(r0, valid);
    const VI::i w1 = FULL ? _mm512_loadu_si512(r1) : VI::load_bytes(r1, valid);
    const VI::i w2 = FULL ? _mm512_loadu_si512(r2) : VI::load_bytes(r2, valid);
    const VI::i w3 = FULL ? _mm512_loadu_si512(r3) : VI::load_bytes(r3, valid);
    const VI::i t0 = _mm512_unpacklo_epi8(w0, w1), t1 = _mm512_unpackhi_epi8(w0, w1);
    const VI::i t2 = _mm512_unpacklo_epi8(w2, w3), t3 = _mm512_unpackhi_epi8(w2, w3);
    const VI::i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
    const VI::i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
    for (int mb = 0; mb < MB; ++mb) {
        int32_t *q = acc + mb * lda;
        _mm512_store_si512(q, VI::dot(_mm512_load_si512(q), u0, b[mb]));
        _mm512_store_si512(q + 16, VI::dot(_mm512_load_si512(q + 16), u1, b[mb]));
        _mm512_store_si512(q + 32, VI::dot(_mm512_load_si512(q + 32), u2, b[mb]));
        _mm512_store_si512(q + 48, VI::dot(_mm512_load_si512(q + 48), u3, b[mb]));
    }
}

inline void w8_prefetch(const uint8_t *p) { _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T1); }

// 4 code rows (pointers at column c0) across the whole tile [c0, c1); the same columns of the 4 rows
// `ahead` are prefetched into L2 (not L1: with N a multiple of 4096 all those rows share L1 sets).
template <int MB>
inline void w8v_rows(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2, const uint8_t *r3,
                     const uint8_t *const (&ahead)[4], int64_t width, const int8_t *a, int64_t kp, int32_t *acc,
                     int64_t lda) {
    VI::i b[MB];
    for (int mb = 0; mb < MB; ++mb) b[mb] = VI::bcast4(a + mb * kp);
    int64_t c = 0;
    for (; c + 64 <= width; c += 64) {
        if (ahead[0]) w8_prefetch(ahead[0] + c), w8_prefetch(ahead[1] + c), w8_prefetch(ahead[2] + c), w8_prefetch(ahead[3] + c);
        w8v_step<MB, true>(r0 + c, r1 + c, r2 + c, r3 + c, 64, b, acc + c, lda);
    }
    if (c < width) w8v_step<MB, false>(r0 + c, r1 + c, r2 + c, r3 + c, width - c, b, acc + c, lda);
}

// 8 consecutive code rows r, r + n, ..., r + 7n (64 columns) for MB token rows: two 4-row interleaves
// into one load and store of each accumulator (b0: rows 0-3, b1: rows 4-7 of the activations).
template <int MB, bool FULL>
inline void w8v_step8(const uint8_t *r, int64_t n, int64_t valid, const VI::i (&b0)[MB], const VI::i (&b1)[MB],
                      int32_t *acc, int64_t lda) {
    VI::i u[2][4];
    for (int h = 0; h < 2; ++h) {
        const uint8_t *q = r + 4 * h * n;
        const VI::i w0 = FULL ? _mm512_loadu_si512(q) : VI::load_bytes(q, valid);
        const VI::i w1 = FULL ? _mm512_loadu_si512(q + n) : VI::load_bytes(q + n, valid);
        const VI::i w2 = FULL ? _mm512_loadu_si512(q + 2 * n) : VI::load_bytes(q + 2 * n, valid);
        const VI::i w3 = FULL ? _mm512_loadu_si512(q + 3 * n) : VI::load_bytes(q + 3 * n, valid);
        const VI::i t0 = _mm512_unpacklo_epi8(w0, w1), t1 = _mm512_unpackhi_epi8(w0, w1);
        const VI::i t2 = _mm512_unpacklo_epi8(w2, w3), t3 = _mm512_unpackhi_epi8(w2, w3);
        u[h][0] = _mm512_unpacklo_epi16(t0, t2), u[h][1] = _mm512_unpackhi_epi16(t0, t2);
        u[h][2] = _mm512_unpacklo_epi16(t1, t3), u[h][3] = _mm512_unpackhi_epi16(t1, t3);
    }
    for (int mb = 0; mb < MB; ++mb) {
        int32_t *q = acc + mb * lda;
        for (int v = 0; v < 4; ++v)
            _mm512_store_si512(q + 16 * v, VI::dot(VI::dot(_mm512_load_si512(q + 16 * v), u[0][v], b0[mb]), u[1][v], b1[mb]));
    }
}

// 8 consecutive code rows from r across the whole tile; rows `ahead` rows further are prefetched into L2.
template <int MB>
inline void w8v_rows8(const uint8_t *r, int64_t n, int64_t ahead, int64_t width, const int8_t *a, int64_t kp,
                      int32_t *acc, int64_t lda) {
    VI::i b0[MB], b1[MB];
    for (int mb = 0; mb < MB; ++mb) b0[mb] = VI::bcast4(a + mb * kp), b1[mb] = VI::bcast4(a + mb * kp + 4);
    int64_t c = 0;
    for (; c + 64 <= width; c += 64) {
        if (ahead)
            for (int j = 0; j < 8; ++j) w8_prefetch(r + (ahead + j) * n + c);
        w8v_step8<MB, true>(r + c, n, 64, b0, b1, acc + c, lda);
    }
    if (c < width) w8v_step8<MB, false>(r + c, n, width - c, b0, b1, acc + c, lda);
}

// Small M: rows [0, MB) of y, columns [c0, c1), codes read in place: per segment, each step reads 8
// (at a segment's end 4) code rows across the whole tile (contiguous bytes, so the hardware prefetchers follow, whatever N is),
// into int32 accumulators in a [MB, tile] workspace that stays in L1.
template <class SS, int MB, bool PERM>
inline void w8v_tile(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                     const W8Weight<SS> &w, int64_t k, int64_t c0, int64_t c1, float *y, int32_t *acc) {
    const int64_t nseg = int64_t(segs.size()), n = w.n, kp = p.kp, width = c1 - c0;
    const int64_t lda = (width + 63) / 64 * 64;
    for (int64_t sg = s0; sg < s1; ++sg) {
        const Segment &seg = segs[sg];
        std::memset(acc, 0, size_t(MB * lda) * sizeof(int32_t));
        const int8_t *a = p.q.data() + p.pstart[sg];
        const int64_t body = seg.start + (seg.end - seg.start) / 4 * 4;
        int64_t i = seg.start;
        const uint8_t *const none[4] = {nullptr, nullptr, nullptr, nullptr};
        if (!PERM) {
            const uint8_t *r = w.qw + i * n + c0;
            for (; i + 8 <= body; i += 8, a += 8, r += 8 * n)
                w8v_rows8<MB>(r, n, i + kVnniPrefetchRows + 8 <= k ? kVnniPrefetchRows : 0, width, a, kp, acc, lda);
            for (; i < body; i += 4, a += 4, r += 4 * n) {
                const int64_t d = (i + kVnniPrefetchRows + 4 <= k ? kVnniPrefetchRows : 0) * n;
                const uint8_t *const ahead[4] = {r + d, r + n + d, r + 2 * n + d, r + 3 * n + d};
                w8v_rows<MB>(r, r + n, r + 2 * n, r + 3 * n, d ? ahead : none, width, a, kp, acc, lda);
            }
        } else {
            for (; i < body; i += 4, a += 4) {
                const int64_t j = i + kVnniPrefetchRows;
                const bool pf = j + 4 <= k;
                const uint8_t *const ahead[4] = {pf ? w.row(j) + c0 : nullptr, pf ? w.row(j + 1) + c0 : nullptr,
                                                 pf ? w.row(j + 2) + c0 : nullptr, pf ? w.row(j + 3) + c0 : nullptr};
                w8v_rows<MB>(w.row(i) + c0, w.row(i + 1) + c0, w.row(i + 2) + c0, w.row(i + 3) + c0, ahead, width, a,
                             kp, acc, lda);
            }
        }
        if (i < seg.end) {  // the last rows of a segment whose length is not a multiple of 4 (x is zero past its end)
            const int64_t last = seg.end - 1;
            w8v_rows<MB>(w.row(i) + c0, w.row(std::min(i + 1, last)) + c0, w.row(std::min(i + 2, last)) + c0,
                         w.row(std::min(i + 3, last)) + c0, none, width, a, kp, acc, lda);
        }
        for (int64_t c = 0; c < width; c += 64) {
            VI::i o[MB][4];
            for (int mb = 0; mb < MB; ++mb) {
                const int32_t *q = acc + mb * lda + c;
                VI::transpose_blocks(_mm512_load_si512(q), _mm512_load_si512(q + 16), _mm512_load_si512(q + 32),
                                     _mm512_load_si512(q + 48), o[mb]);
            }
            for (int v = 0; v < 4; ++v) {
                const __mmask16 mask = w8_lanes(width - c - 16 * v);
                if (!mask) break;
                const int64_t col = c0 + c + 16 * v;
                const V::f s = w.scale(seg.group, col, mask), z = w.zero(seg.group, col, mask);
                for (int mb = 0; mb < MB; ++mb)
                    w8_accumulate(o[mb][v], s, z, p.sum[mb * nseg + sg], sg == s0, y + mb * n + col, mask);
            }
        }
    }
}

template <class SS, int MB>
inline void w8v_columns(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                        const W8Weight<SS> &w, int64_t k, int64_t c0, int64_t c1, float *y, int32_t *acc) {
    if (w.perm) w8v_tile<SS, MB, true>(p, segs, s0, s1, w, k, c0, c1, y, acc);
    else w8v_tile<SS, MB, false>(p, segs, s0, s1, w, k, c0, c1, y, acc);
}

// Pack columns [c0, c0 + valid) of the codes, rows of segments [s0, s1), into
// dot-product panels [rows / 4][64][4], 64-column panel j at dst + j * pitch. Four code rows at a time are read as
// four contiguous runs across the whole block (what the hardware prefetchers follow, whatever N is); the same
// columns of the rows kVnniPrefetchRows ahead are prefetched into L2.
template <class SS>
inline void w8_pack_block(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                          const W8Weight<SS> &w, int64_t k, int64_t c0, int64_t valid, uint8_t *dst, int64_t pitch) {
    const int64_t base = p.pstart[s0];
    for (int64_t sg = s0; sg < s1; ++sg) {
        const int64_t last = segs[sg].end - 1;
        uint8_t *d = dst + (p.pstart[sg] - base) * 64;
        for (int64_t i = segs[sg].start; i < segs[sg].end; i += 4, d += 256) {
            const uint8_t *r0 = w.row(i) + c0, *r1 = w.row(std::min(i + 1, last)) + c0;
            const uint8_t *r2 = w.row(std::min(i + 2, last)) + c0, *r3 = w.row(std::min(i + 3, last)) + c0;
            const bool ahead = !w.perm && i + kVnniPrefetchRows + 4 <= k;
            for (int64_t c = 0; c < valid; c += 64) {
                if (ahead)
                    for (int64_t j = 0; j < 4; ++j) w8_prefetch(r0 + (kVnniPrefetchRows + j) * w.n + c);
                const int64_t v = std::min<int64_t>(64, valid - c);
                VI::i o[4];
                VI::interleave4(VI::load_bytes(r0 + c, v), VI::load_bytes(r1 + c, v), VI::load_bytes(r2 + c, v),
                                VI::load_bytes(r3 + c, v), o);
                uint8_t *out = d + (c / 64) * pitch;
                for (int q = 0; q < 4; ++q) _mm512_store_si512(out + 64 * q, o[q]);
            }
        }
    }
}

// Rows [r0, r0 + MR) x one packed 64-column panel holding segments [s0, s1) (from p.pstart[s0] on).
template <class SS, int MR>
inline void w8_tile_rows(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                         const W8Weight<SS> &w, const uint8_t *panel, int64_t r0, int64_t c0, int64_t valid,
                         float *y) {
    const int64_t nseg = int64_t(segs.size()), kp = p.kp;
    for (int64_t sg = s0; sg < s1; ++sg) {
        VI::i acc[MR][4];
        for (int r = 0; r < MR; ++r)
            for (int v = 0; v < 4; ++v) acc[r][v] = VI::zero();
        const int8_t *a = p.q.data() + r0 * kp + p.pstart[sg];
        const uint8_t *b = panel + (p.pstart[sg] - p.pstart[s0]) * 64;
        const int64_t steps = (p.pstart[sg + 1] - p.pstart[sg]) / 4;
        for (int64_t t = 0; t < steps; ++t, a += 4, b += 256) {
            const VI::i b0 = _mm512_load_si512(b), b1 = _mm512_load_si512(b + 64);
            const VI::i b2 = _mm512_load_si512(b + 128), b3 = _mm512_load_si512(b + 192);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
                const VI::i x = VI::bcast4(a + r * kp);
                acc[r][0] = VI::dot(acc[r][0], b0, x);
                acc[r][1] = VI::dot(acc[r][1], b1, x);
                acc[r][2] = VI::dot(acc[r][2], b2, x);
                acc[r][3] = VI::dot(acc[r][3], b3, x);
            }
        }
        for (int v = 0; v < 4; ++v) {
            const __mmask16 mask = w8_lanes(valid - 16 * v);
            if (!mask) break;
            const int64_t col = c0 + 16 * v;
            const V::f s = w.scale(segs[sg].group, col, mask), z = w.zero(segs[sg].group, col, mask);
            for (int r = 0; r < MR; ++r)
                w8_accumulate(acc[r][v], s, z, p.sum[(r0 + r) * nseg + sg], sg == 0, y + (r0 + r) * w.n + col, mask);
        }
    }
}

// Every row of y x one packed panel (columns [c0, c0 + valid)) over segments [s0, s1): register tiles of
// kVnniTileRows rows, then the remainder.
template <class SS>
inline void w8_panel_rows(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                          const W8Weight<SS> &w, const uint8_t *panel, int64_t m, int64_t c0, int64_t valid,
                          float *y) {
    int64_t r = 0;
    for (; r + kVnniTileRows <= m; r += kVnniTileRows)
        w8_tile_rows<SS, kVnniTileRows>(p, segs, s0, s1, w, panel, r, c0, valid, y);
    switch (m - r) {
        case 5: w8_tile_rows<SS, 5>(p, segs, s0, s1, w, panel, r, c0, valid, y); break;
        case 4: w8_tile_rows<SS, 4>(p, segs, s0, s1, w, panel, r, c0, valid, y); break;
        case 3: w8_tile_rows<SS, 3>(p, segs, s0, s1, w, panel, r, c0, valid, y); break;
        case 2: w8_tile_rows<SS, 2>(p, segs, s0, s1, w, panel, r, c0, valid, y); break;
        case 1: w8_tile_rows<SS, 1>(p, segs, s0, s1, w, panel, r, c0, valid, y); break;
        default: break;
    }
}

#include "w8a8_amx.inl"

template <class SS>
int w8a8_vnni_t(const hal_cpu_w8a8_gemm_args &a, const std::vector<Segment> &segs) {
    const int32_t k_parts = a.k_parts, threads = a.threads;
    const int64_t m = a.m, k = a.k, n = a.n, n_tile = a.n_tile;
    float *y = a.y;
    W8Panel p;
    w8_quantise(a.x, a.x_dtype, a.x_stride, m, k, a.perm, segs, p, threads);
    const W8Weight<SS> w{a.qweight, n, a.perm, static_cast<const typename SS::T *>(a.scales), a.zeros,
                         float(a.default_zero)};
    if (segs.empty()) {
        std::fill(y, y + m * n, 0.0f);
    } else if (m <= kVnniGemvRows) {
        const int64_t tile = std::min(kVnniAccWords / m / 64 * 64, std::max<int64_t>(64, n_tile / 64 * 64));
        // M <= 2: K in parts (parts.inl), segments split as the float kernel splits them (w8a8_t).
        const int64_t nseg = int64_t(segs.size()), parts = m <= 2 ? k_part_count(k_parts, nseg) : 1;
        run_k_parts(parts, m, n, n, tile, 0, y, threads,
                    [&](int64_t part, int64_t c0, int64_t c1, float *out, float *) {
            const int64_t s0 = nseg * part / parts, s1 = nseg * (part + 1) / parts;
            alignas(64) int32_t acc[kVnniAccWords];
            if (m == 1) w8v_columns<SS, 1>(p, segs, s0, s1, w, k, c0, c1, out, acc);
            else if (m == 2) w8v_columns<SS, 2>(p, segs, s0, s1, w, k, c0, c1, out, acc);
            else if (m == 3) w8v_columns<SS, 3>(p, segs, s0, s1, w, k, c0, c1, out, acc);
            else w8v_columns<SS, 4>(p, segs, s0, s1, w, k, c0, c1, out, acc);
        });
    } else {
        // A task owns a block of 64-column panels and walks K in chunks of whole segments (about
        // kVnniChunkRows rows): it packs the chunk's codes for its block (contiguous runs of each code row,
        // in L2), then runs every row tile over each panel. One workspace per running task, all allocated
        // before any output is written.
        const int64_t nseg = int64_t(segs.size());
        const bool amx = w8a8_amx_applies(a, p, nseg);
        const std::vector<int8_t> tiles = amx ? w8_amx_tiles(p, m, threads) : std::vector<int8_t>();
        std::vector<int64_t> chunk{0};  // chunk c: segments [chunk[c], chunk[c + 1])
        for (int64_t sg = 1; sg <= nseg; ++sg)
            if (sg == nseg || p.pstart[sg + 1] - p.pstart[chunk.back()] > kVnniChunkRows) chunk.push_back(sg);
        int64_t rows = 0;  // padded rows of the largest chunk
        for (size_t c = 0; c + 1 < chunk.size(); ++c) rows = std::max(rows, p.pstart[chunk[c + 1]] - p.pstart[chunk[c]]);
        // Panels per block: as many as fit kVnniPackBytes (at most kVnniBlockPanels), spread evenly over a multiple
        // of the thread count. A panel's pitch is padded off multiples of 4 KiB, so that the packing stores to
        // the block's panels do not all fall in the same L1 sets.
        const int64_t pitch = rows * 64 + 5 * 64;
        const int64_t panels = (n + 63) / 64, nthreads = std::max<int32_t>(threads, 1);
        const int64_t widest = std::max<int64_t>(1, std::min<int64_t>(kVnniBlockPanels, kVnniPackBytes / pitch));
        const int64_t blocks = nthreads * ((panels + widest * nthreads - 1) / (widest * nthreads));
        const int64_t block_panels = (panels + blocks - 1) / blocks, block = 64 * block_panels;
        TaskSlots slots(std::min<int64_t>(blocks, nthreads));
        const size_t bytes = size_t(pitch) * block_panels;
        std::vector<uint8_t *> workspaces;  // indexed by slot
        workspaces.reserve(size_t(slots.count()));
        for (int64_t s = 0; s < slots.count(); ++s) {
            auto *buffer = static_cast<uint8_t *>(_mm_malloc(bytes, 64));
            if (!buffer) {
                for (uint8_t *q : workspaces) _mm_free(q);
                return HAL_ENOMEM;
            }
            workspaces.push_back(buffer);
        }
        parallel_for(blocks, threads, [&](int64_t t) {
            const int64_t slot = slots.acquire();
            uint8_t *buffer = workspaces[size_t(slot)];
            const int64_t c0 = t * block, width = std::min(block, n - c0);
            if (width <= 0) {
                slots.release(slot);
                return;
            }
            for (size_t c = 0; c + 1 < chunk.size(); ++c) {
                w8_pack_block<SS>(p, segs, chunk[c], chunk[c + 1], w, k, c0, width, buffer, pitch);
                for (int64_t j = 0; j * 64 < width; ++j) {
                    const int64_t valid = std::min<int64_t>(64, width - 64 * j);
                    if (amx)
                        w8_amx_panel<SS>(p, segs, chunk[c], chunk[c + 1], w, buffer + j * pitch, tiles.data(), m,
                                         c0 + 64 * j, valid, y);
                    else
                        w8_panel_rows<SS>(p, segs, chunk[c], chunk[c + 1], w, buffer + j * pitch, m, c0 + 64 * j,
                                          valid, y);
                }
            }
            slots.release(slot);
        });
        for (uint8_t *q : workspaces) _mm_free(q);
    }
    parallel_for(m, threads, [&](int64_t r) {
        float *yr = y + r * n;
        const V::f s = V::set1(p.sx[r]);
        int64_t i = 0;
        for (; i + W <= n; i += W) V::store(yr + i, V::mul(V::load(yr + i), s));
        for (; i < n; ++i) yr[i] *= p.sx[r];
    });
    return HAL_OK;
}
