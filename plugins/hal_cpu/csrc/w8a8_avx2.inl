// w8a8_avx2.inl: included by w8a8.inl in the avx2 and avx512 variants (256-bit code only: the avx512 variant
// runs on CPUs without VNNI, where these are its integer products); not a standalone header.
// ---------------------------------------------------------------------------------------------
// W8A8 on AVX2: int16 pairs of code rows times int16 pairs of activations in vpmaddwd, summed in int32
// ---------------------------------------------------------------------------------------------
//
// vpmaddubsw cannot take the uint8 codes against the int8 activations here (2 * 255 * 127 saturates int16),
// so two code rows are interleaved byte by byte and widened to int16 (vpunpcklbw, vpmovzxbw: 8 columns x 2
// rows per vector, amortised over the tile's rows), and vpmaddwd multiplies them by the broadcast pair of the
// row's activations (q[i], q[i + 1]) and adds the two products into an int32 lane. A segment (at most
// kExactRows rows of one group) sums to at most 255 * 127 * 512 < 2**24 per lane, so every sum is the exact
// integer the float kernel sums in fp32; the epilogue d = sum - z * sum(q) is exact in int32 and converts with
// one rounding, as the float kernel's fnma does, then y = fma(scale, float(d), y) segment after segment from
// y = 0. The same operations in the same order: the same bits as every other variant (segments of odd length
// pair their last row with a zero activation and re-read a real code row).
//
// Tasks walk their columns in chunks (as wide as L2 allows for the rows of the output and one segment's codes:
// walking K for a narrow block of columns touches a page per code row, and the TLB misses cost more than the
// arithmetic). For each segment, every 16 columns' codes (a segment's rows x 16 bytes, in L1) are read by every
// row tile of up to 6 rows x 16 columns (12 int32 accumulators, 2 code vectors, one broadcast: 15 of the 16
// vector registers), widened by each tile, or from kW8Avx2PackRows rows widened once into a 16 KiB stack buffer
// that every tile reads (two aligned loads a step instead of two loads, two unpacks and two widenings). M = 1
// keeps float sums, faster with no rows to share the widening over (4096 x 4096 on a 2-core AMD EPYC: 1.0-1.1 ms
// against 1.7-1.8; at M = 2 the pairs are level or faster: 4096 x 11008, 2.9 ms against 4.5), swept across each
// task's columns (w8_avx2_sweep1, below).

//: Rows of x per register tile; a task's columns are walked in chunks (a multiple of kW8Avx2Cols) whose rows of
//: the output and one segment's codes take at most kW8Avx2ChunkBytes (L2), each chunk segment after segment.
constexpr int kW8Avx2Rows = 6;
constexpr int64_t kW8Avx2Cols = 64;
constexpr int64_t kW8Avx2ChunkBytes = 256 * 1024;
//: From this many rows a segment's widened codes are packed once per 16 columns and read by every row tile (2-core
//: AMD EPYC, 4096 x 4096: 1.3x faster at M = 64..512; level at 16; slower at 8, where two tiles share them).
constexpr int64_t kW8Avx2PackRows = 16;

// Eight scales of type SS from p, as float32 (also W4A8's, w4a8_avx2.inl).
template <class SS>
inline __m256 avx2_scales(const typename SS::T *p) {
    if constexpr (std::is_same_v<SS, F32>) {
        return _mm256_loadu_ps(p);
    } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        if constexpr (std::is_same_v<SS, F16>) return _mm256_cvtph_ps(h);
        else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
}

// The quantised activations as int16 pairs, one int32 word per two rows of a segment.
struct W8Pairs {
    int64_t kw = 0;               // words per row of x
    std::vector<int64_t> pstart;  // [nseg + 1] first word of each segment
    std::vector<int32_t> words;   // [m, kw] (q[i], q[i + 1]) low half first; q past a segment's odd end is 0
    std::vector<int32_t> sum;     // [m, nseg] the segments' sums of q
};

// xq: [m, k] quantised activations as floats (integers in [-127, 127], in the segments' row order);
// xqsum: [m, nseg] their segment sums.
inline void w8_avx2_pairs(const float *xq, const float *xqsum, int64_t m, int64_t k, const std::vector<Segment> &segs,
                          W8Pairs &p, int32_t threads) {
    const int64_t nseg = int64_t(segs.size());
    p.pstart.assign(size_t(nseg) + 1, 0);
    for (int64_t s = 0; s < nseg; ++s) p.pstart[s + 1] = p.pstart[s] + (segs[s].end - segs[s].start + 1) / 2;
    p.kw = std::max<int64_t>(p.pstart[nseg], 1);
    p.words.assign(size_t(m * p.kw), 0);
    p.sum.assign(size_t(m * std::max<int64_t>(nseg, 1)), 0);
    parallel_for(m, threads, [&](int64_t r) {
        const float *row = xq + r * k;
        int32_t *words = p.words.data() + r * p.kw;
        for (int64_t s = 0; s < nseg; ++s) {
            const Segment sg = segs[s];
            for (int64_t i = sg.start; i < sg.end; i += 2) {
                const auto lo = uint16_t(int16_t(row[i]));
                const auto hi = uint16_t(i + 1 < sg.end ? int16_t(row[i + 1]) : int16_t(0));
                words[p.pstart[s] + (i - sg.start) / 2] = int32_t(uint32_t(lo) | uint32_t(hi) << 16);
            }
            p.sum[r * nseg + s] = int32_t(xqsum[r * nseg + s]);
        }
    });
}

// What every tile of one call reads.
template <class SS>
struct W8Avx2Job {
    const W8Pairs &p;
    const Segment *segs;
    int64_t nseg, n;
    const int32_t *perm;
    const uint8_t *qw, *zeros;
    const typename SS::T *scales;
    int32_t zdef;
};

// Code rows row0 and row1, columns [0, 8 NV): NV vectors of 8 columns x the 2 rows as int16 pairs.
template <int NV>
inline void w8_avx2_codes(const uint8_t *row0, const uint8_t *row1, __m256i (&code)[NV]) {
    static_assert(NV == 1 || NV == 2, "one or two vectors of 8 columns");
    if constexpr (NV == 2) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row0));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row1));
        code[0] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
        code[NV - 1] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b));
    } else {
        const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row0));
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row1));
        code[0] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
    }
}

// fn(row0, row1) for each row pair of segment sgi at column c, in order (the last row of an odd segment twice,
// against q = 0).
template <class SS, class Fn>
inline void w8_avx2_pairs_of(const W8Avx2Job<SS> &j, int64_t c, int64_t sgi, Fn &&fn) {
    const Segment sg = j.segs[sgi];
    const int64_t n = j.n, pairs_end = sg.start + (sg.end - sg.start) / 2 * 2;
    if (j.perm) {
        for (int64_t i = sg.start; i < pairs_end; i += 2)
            fn(j.qw + int64_t(j.perm[i]) * n + c, j.qw + int64_t(j.perm[i + 1]) * n + c);
    } else {
        const uint8_t *row = j.qw + sg.start * n + c;
        for (int64_t i = sg.start; i < pairs_end; i += 2, row += 2 * n) fn(row, row + n);
    }
    if (pairs_end < sg.end) {
        const uint8_t *last = j.qw + (j.perm ? int64_t(j.perm[pairs_end]) : pairs_end) * n + c;
        fn(last, last);
    }
}

// Rows [r0, r0 + MR) x columns [c, c + 8 NV) over segment sgi: out = fma(scale, float(d), out) (row stride n).
// The codes come from the weight, or (packed not null) from w8_avx2_pack's copy of them.
template <class SS, int MR, int NV>
inline void w8_avx2_tile(const W8Avx2Job<SS> &j, int64_t r0, int64_t c, int64_t sgi, const __m256i *packed,
                         float *out) {
    const Segment sg = j.segs[sgi];
    const int64_t n = j.n, kw = j.p.kw;
    __m256i acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
    const int32_t *xw = j.p.words.data() + r0 * kw + j.p.pstart[sgi];
    const auto multiply = [&](const __m256i (&code)[NV]) {
        for (int r = 0; r < MR; ++r) {
            const __m256i x = _mm256_set1_epi32(xw[r * kw]);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(code[v], x));
        }
        ++xw;
    };
    if (packed) {
        const int64_t pairs = (sg.end - sg.start + 1) / 2;
        for (int64_t w = 0; w < pairs; ++w, packed += NV) {
            __m256i code[NV];
            for (int v = 0; v < NV; ++v) code[v] = _mm256_load_si256(packed + v);
            multiply(code);
        }
    } else {
        w8_avx2_pairs_of(j, c, sgi, [&](const uint8_t *row0, const uint8_t *row1) {
            __m256i code[NV];
            w8_avx2_codes<NV>(row0, row1, code);
            multiply(code);
        });
    }
    for (int v = 0; v < NV; ++v) {
        const int64_t col = int64_t(sg.group) * n + c + 8 * v;
        const __m256 s = avx2_scales<SS>(j.scales + col);
        const __m256i z = j.zeros
                              ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(j.zeros + col)))
                              : _mm256_set1_epi32(j.zdef);
        for (int r = 0; r < MR; ++r) {
            const __m256i qs = _mm256_set1_epi32(j.p.sum[(r0 + r) * j.nseg + sgi]);
            const __m256i d = _mm256_sub_epi32(acc[r][v], _mm256_mullo_epi32(z, qs));
            float *o = out + (r0 + r) * n + c + 8 * v;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), _mm256_loadu_ps(o)));
        }
    }
}

// Every row over segment sgi at columns [c, c + 8 NV): row tiles of 6 rows, the last 7 or 8 rows as two tiles of
// about 4 (a 1- or 2-row tile reads codes for little). From kW8Avx2PackRows rows the segment's codes are widened
// once into packed (kExactRows / 2 * NV vectors) and every tile reads them from there.
template <class SS, int NV>
inline void w8_avx2_rows(const W8Avx2Job<SS> &j, int64_t m, int64_t c, int64_t sgi, __m256i *packed, float *out) {
    if (m >= kW8Avx2PackRows) {
        __m256i *dst = packed;
        w8_avx2_pairs_of(j, c, sgi, [&](const uint8_t *row0, const uint8_t *row1) {
            __m256i code[NV];
            w8_avx2_codes<NV>(row0, row1, code);
            for (int v = 0; v < NV; ++v) _mm256_store_si256(dst++, code[v]);
        });
    } else {
        packed = nullptr;
    }
    int64_t r = 0;
    for (; m - r >= kW8Avx2Rows && m - r != kW8Avx2Rows + 1 && m - r != kW8Avx2Rows + 2; r += kW8Avx2Rows)
        w8_avx2_tile<SS, kW8Avx2Rows, NV>(j, r, c, sgi, packed, out);
    if (m - r > kW8Avx2Rows) {
        w8_avx2_tile<SS, 4, NV>(j, r, c, sgi, packed, out);
        r += 4;
    }
    switch (m - r) {
        case 6: w8_avx2_tile<SS, 6, NV>(j, r, c, sgi, packed, out); break;
        case 5: w8_avx2_tile<SS, 5, NV>(j, r, c, sgi, packed, out); break;
        case 4: w8_avx2_tile<SS, 4, NV>(j, r, c, sgi, packed, out); break;
        case 3: w8_avx2_tile<SS, 3, NV>(j, r, c, sgi, packed, out); break;
        case 2: w8_avx2_tile<SS, 2, NV>(j, r, c, sgi, packed, out); break;
        case 1: w8_avx2_tile<SS, 1, NV>(j, r, c, sgi, packed, out); break;
        default: break;
    }
}

// Every row of out (row stride n) over segments [s0, s1), columns [c0, c1) cut to whole vectors of 8, from 0.
// Returns where the vectors end: the columns past it are the caller's.
template <class SS>
inline int64_t w8_avx2_columns(const W8Avx2Job<SS> &j, int64_t m, int64_t c0, int64_t c1, int64_t s0, int64_t s1,
                               float *out) {
    const int64_t end = c0 + (c1 - c0) / 8 * 8;
    for (int64_t r = 0; r < m; ++r) std::fill(out + r * j.n + c0, out + r * j.n + end, 0.0f);
    // Column chunks whose rows of out and one segment's codes stay in L2 (kW8Avx2ChunkBytes).
    const int64_t chunk = std::max<int64_t>(kW8Avx2Cols, kW8Avx2ChunkBytes / (4 * m + kExactRows) / kW8Avx2Cols *
                                                             kW8Avx2Cols);
    // The widened codes of one segment and 16 columns (from kW8Avx2PackRows rows): 16 KiB of stack (nothing is
    // allocated inside a pool task).
    alignas(32) __m256i packed[kExactRows];
    for (int64_t cb = c0; cb < end; cb += chunk) {
        const int64_t ce = std::min(end, cb + chunk);
        for (int64_t sgi = s0; sgi < s1; ++sgi) {
            int64_t c = cb;
            for (; c + 16 <= ce; c += 16) w8_avx2_rows<SS, 2>(j, m, c, sgi, packed, out);
            if (c < ce) w8_avx2_rows<SS, 1>(j, m, c, sgi, packed, out);
        }
    }
    return end;
}

//: Columns of one M = 1 sweep chunk: its float32 sums and totals (2 x 16 KiB, on the stack) stay in L1/L2 while each
//: code row of a segment is read as one contiguous run of the chunk's bytes.
constexpr int64_t kW8Avx2SweepCols = 4096;

// Eight uint8 values from p, as float32.
inline __m256 w8_avx2_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

// M = 1: columns [c0, c1) over segments [s0, s1) into out, swept. For each segment the code rows are read 8 at a time
// across a chunk of up to kW8Avx2SweepCols columns (each a long contiguous run, which the prefetchers follow; the
// register tiles of w8_tile read 32 bytes of every code row per 32 columns, a page per row, and ran at 0.4 of the
// copy bandwidth), their products with the row's quantised activations summed into acc: exact integers below 2**24,
// so the same sums as w8_tile's in any order. Then tot = fma(s, fnma(z, xqsum, acc), tot) segment after segment from
// tot = 0, as w8_tile does: the same bits. Returns the first column left (whole vectors of 8 are done).
template <class SS>
inline int64_t w8_avx2_sweep1(const float *xq, const float *xqsum, const Segment *segs, int64_t s0, int64_t s1,
                              const int32_t *perm, const uint8_t *qw, int64_t n, const typename SS::T *scales,
                              const uint8_t *zeros, float zdef, int64_t c0, int64_t c1, float *out) {
    const int64_t end = c0 + (c1 - c0) / 8 * 8;
    alignas(32) float acc[kW8Avx2SweepCols];
    alignas(32) float tot[kW8Avx2SweepCols];
    const auto row = [&](int64_t i) { return qw + (perm ? int64_t(perm[i]) : i) * n; };
    for (int64_t cc = c0; cc < end; cc += kW8Avx2SweepCols) {
        const int64_t w = std::min(kW8Avx2SweepCols, end - cc);
        for (int64_t j = 0; j < w; j += 8) _mm256_store_ps(tot + j, _mm256_setzero_ps());
        for (int64_t sgi = s0; sgi < s1; ++sgi) {
            const Segment sg = segs[sgi];
            for (int64_t j = 0; j < w; j += 8) _mm256_store_ps(acc + j, _mm256_setzero_ps());
            int64_t i = sg.start;
            for (; i + 8 <= sg.end; i += 8) {
                const uint8_t *r[8];
                __m256 xb[8];
                for (int t = 0; t < 8; ++t) {
                    r[t] = row(i + t) + cc;
                    xb[t] = _mm256_set1_ps(xq[i + t]);
                }
                for (int64_t j = 0; j < w; j += 8) {
                    __m256 s = _mm256_load_ps(acc + j);
                    for (int t = 0; t < 8; ++t) s = _mm256_fmadd_ps(xb[t], w8_avx2_u8(r[t] + j), s);
                    _mm256_store_ps(acc + j, s);
                }
            }
            for (; i < sg.end; ++i) {
                const uint8_t *r = row(i) + cc;
                const __m256 xb = _mm256_set1_ps(xq[i]);
                for (int64_t j = 0; j < w; j += 8)
                    _mm256_store_ps(acc + j, _mm256_fmadd_ps(xb, w8_avx2_u8(r + j), _mm256_load_ps(acc + j)));
            }
            const __m256 xs = _mm256_set1_ps(xqsum[sgi]);
            const int64_t base = int64_t(sg.group) * n + cc;
            for (int64_t j = 0; j < w; j += 8) {
                const __m256 s = avx2_scales<SS>(scales + base + j);
                const __m256 z = zeros ? w8_avx2_u8(zeros + base + j) : _mm256_set1_ps(zdef);
                const __m256 d = _mm256_fnmadd_ps(z, xs, _mm256_load_ps(acc + j));
                _mm256_store_ps(tot + j, _mm256_fmadd_ps(s, d, _mm256_load_ps(tot + j)));
            }
        }
        for (int64_t j = 0; j < w; j += 8) _mm256_storeu_ps(out + cc + j, _mm256_load_ps(tot + j));
    }
    return end;
}
