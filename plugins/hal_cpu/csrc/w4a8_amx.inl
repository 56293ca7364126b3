// w4a8_amx.inl: included by w4a8.inl in the avx512vnni variant; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W4A8 for many rows on AMX-INT8 tiles: tdpbsud multiplies a 16 x 64 tile of signed bytes (the
// quantised activations) by a 64 x 16 tile of unsigned bytes (the int4 codes) into 16 x 16 int32
// sums, exactly, 16384 multiply-adds per instruction (vpdpbusd: 64); for symmetric weights tdpbssd
// takes the codes minus the zero point as signed bytes, so the sums need no zero-point term.
//
// The integer sums of a group are the ones w4a8.inl's kernels form (exact in int32), and each group
// is applied in the same order with the same operations, y = fma(scale, float(sum - z * sum(q)), y),
// so this path gives the bits of every other variant.
//
// A: 16 rows of the activation panel, 64 bytes of K each, in the panel's own order (each 8-row step
//    as q0, q2, q4, q6, q1, q3, q5, q7; rows past M are zero), copied once per call into contiguous
//    1 KiB tiles (rows of the panel 4 KiB apart would share L1 sets: a tile load would miss).
// B: 16 tile rows of 64 bytes, four bytes per column: tile row 2w holds the low nibbles of code row w
//    (rows 8w, 8w + 2, 8w + 4, 8w + 6 of K: the A order's first four), tile row 2w + 1 the high
//    nibbles (rows 8w + 1, 3, 5, 7). A code row masked and shifted is a tile row: unpacking is two
//    instructions per 64 bytes, done once per task for kW4a8AmxChunk rows of K and reused by every row
//    tile of the call.
// C: 2 x 2 tiles (32 rows x 32 columns) per group, stored to the stack and applied to y (float32, the
//    task's columns of rows in L1) with the group's scales and zero points.
//
// Applies with AMX-TILE and AMX-INT8 and the OS's permission for the tile state (as for attention,
// attention_amx.inl; HAL_CPU_AMX=0 / hal_cpu_set_attention_amx(0) turns both off), at least
// kW4a8AmxMinRows rows, a group size that is a multiple of 64 and at least 32 columns; columns past the
// last multiple of 32 run the vector kernel.
// ---------------------------------------------------------------------------------------------

//: Columns per task: four pairs of B tiles, so one row tile of activations (32 rows) serves 128 columns.
constexpr int64_t kW4a8AmxCols = 128;
//: Fewest rows for the tile path: measured at 4096 x 11008 (bf16 activations, weights from memory), 16 rows take
//: 0.75x the vector kernel's time, 8 rows 0.88x but 1.17x at 2048 x 2048.
constexpr int64_t kW4a8AmxMinRows = 16;
//: Rows of K whose codes a task unpacks at once (kW4a8AmxChunk * 128 bytes, 64 KiB; whole groups).
constexpr int64_t kW4a8AmxChunk = 512;

inline bool w4a8_amx_applies(const hal_cpu_w4a8_gemm_args &a) {
    return a.m >= kW4a8AmxMinRows && a.group_size % 64 == 0 && a.n >= 32 && hal_cpu_attention_amx_allowed() &&
           amx_int8_usable();
}

// The panel's rows as contiguous A tiles (W4a8Panel::tiles), for rows [0, panel rows).
inline void w4a8_amx_tile_panel(const hal_cpu_w4a8_gemm_args &a, W4a8Panel &p) {
    const int64_t k = a.k, steps = k / 64, row_tiles = int64_t(p.q.size()) / k / 16;
    p.tiles.resize(p.q.size());
    parallel_for(row_tiles, a.threads, [&](int64_t rt) {
        for (int64_t s = 0; s < steps; ++s)
            for (int64_t r = 0; r < 16; ++r)
                std::memcpy(p.tiles.data() + ((rt * steps + s) * 16 + r) * 64, p.q.data() + (rt * 16 + r) * k + s * 64,
                            64);
    });
}

// Rows of K per unpacked chunk: whole groups, about kW4a8AmxChunk.
inline int64_t w4a8_amx_chunk(int64_t group) { return group >= kW4a8AmxChunk ? group : kW4a8AmxChunk / group * group; }

// Codes of rows [k0, k0 + kc) x columns [c0, c0 + 16 tiles) as B tiles: tile (s, t) at (s * tiles + t) * 1024
// holds K rows k0 + 64 s .. + 63 of columns c0 + 16 t .. + 15. Symmetric weights (no zero points) store
// code - default_zero as signed bytes, so the tile sums are already sum(q * (code - z)).
template <bool Signed>
HAL_AMX_INT8 inline void w4a8_amx_pack(const hal_cpu_w4a8_gemm_args &a, int64_t c0, int64_t tiles, int64_t k0,
                                       int64_t kc, uint8_t *strip) {
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F), zero = _mm512_set1_epi8(char(a.default_zero));
    const auto code = [&](__m512i v) { return Signed ? _mm512_sub_epi8(v, zero) : v; };
    for (int64_t s = 0; s < kc / 64; ++s)
        for (int64_t t = 0; t < tiles; ++t) {
            uint8_t *tile = strip + (s * tiles + t) * 1024;
            const uint32_t *codes = a.qweight + (k0 / 8 + 8 * s) * a.n + c0 + 16 * t;
            for (int w = 0; w < 8; ++w) {
                const __m512i word = _mm512_loadu_si512(codes + w * a.n);
                _mm512_storeu_si512(tile + 128 * w, code(_mm512_and_si512(word, nibbles)));
                _mm512_storeu_si512(tile + 128 * w + 64, code(_mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles)));
            }
        }
}

// y[r][cols] = fma(scale, float(c - z * sum(q)), y) for the rows of one C tile (rows r0 .. r0 + 15 below m);
// Signed: c is already the difference.
template <class SS, bool Signed>
HAL_AMX_INT8 inline void w4a8_amx_apply(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, const int32_t *c,
                                        int64_t g, int64_t r0, int64_t col) {
    const int64_t n = a.n, groups = a.k / a.group_size, rows = std::min<int64_t>(16, a.m - r0);
    const auto *scales = static_cast<const typename SS::T *>(a.scales);
    const int64_t at = g * n + col;
    const V::f s = vload<SS>(scales + at);
    const VI::i z = !Signed && a.zeros
                        ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a.zeros + at)))
                        : _mm512_set1_epi32(a.default_zero);
    for (int64_t rr = 0; rr < rows; ++rr) {
        const int64_t r = r0 + rr;
        VI::i d = _mm512_loadu_si512(c + 16 * rr);
        if (!Signed) d = _mm512_sub_epi32(d, _mm512_mullo_epi32(z, _mm512_set1_epi32(p.sum[r * groups + g])));
        float *out = a.y + r * n + col;
        V::store(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), V::load(out)));
    }
}

// Every row x columns [c0, c0 + 16 tiles) (tiles even), group after group; strip: kW4a8AmxChunk-sized scratch.
// Signed: symmetric weights, codes stored minus the default zero point (tdpbssd). (Applying each block one block
// late, between the next block's products and its stores, measured slower.)
template <class SS, bool Signed>
HAL_AMX_INT8 void w4a8_amx_block_t(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t tiles,
                                   uint8_t *strip) {
    const int64_t k = a.k, m = a.m, group = a.group_size, chunk = w4a8_amx_chunk(group);
    alignas(64) int32_t c[4][256];
    amx_configure();
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t kc = std::min(chunk, k - k0);
        w4a8_amx_pack<Signed>(a, c0, tiles, k0, kc, strip);
        HAL_AMX_BARRIER();
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const bool two = m - r0 > 16;
            const int8_t *q0 = p.tiles.data() + r0 * k, *q1 = q0 + 16 * k;  // row tiles r0 / 16 and the next
            for (int64_t g = k0 / group; g < (k0 + kc) / group; ++g) {
                for (int64_t t = 0; t < tiles; t += 2) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kk = g * group; kk < (g + 1) * group; kk += 64) {
                        const uint8_t *b = strip + (((kk - k0) / 64) * tiles + t) * 1024;
                        _tile_loadd(4, q0 + kk * 16, 64);
                        _tile_loadd(6, b, 64);
                        _tile_loadd(7, b + 1024, 64);
                        if (Signed) {
                            _tile_dpbssd(0, 4, 6);
                            _tile_dpbssd(1, 4, 7);
                        } else {
                            _tile_dpbsud(0, 4, 6);
                            _tile_dpbsud(1, 4, 7);
                        }
                        if (two) {
                            _tile_loadd(5, q1 + kk * 16, 64);
                            if (Signed) {
                                _tile_dpbssd(2, 5, 6);
                                _tile_dpbssd(3, 5, 7);
                            } else {
                                _tile_dpbsud(2, 5, 6);
                                _tile_dpbsud(3, 5, 7);
                            }
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    HAL_AMX_BARRIER();
                    const int64_t col = c0 + 16 * t;
                    w4a8_amx_apply<SS, Signed>(a, p, c[0], g, r0, col);
                    w4a8_amx_apply<SS, Signed>(a, p, c[1], g, r0, col + 16);
                    if (two) {
                        w4a8_amx_apply<SS, Signed>(a, p, c[2], g, r0 + 16, col);
                        w4a8_amx_apply<SS, Signed>(a, p, c[3], g, r0 + 16, col + 16);
                    }
                }
            }
        }
    }
}

template <class SS>
void w4a8_amx_block(const hal_cpu_w4a8_gemm_args &a, const W4a8Panel &p, int64_t c0, int64_t tiles, uint8_t *strip) {
    // code - z fits a signed byte for every zero point an int4 code can have (0 .. 15); larger ones keep the sums
    // unsigned.
    if (!a.zeros && a.default_zero >= 0 && a.default_zero <= 143) w4a8_amx_block_t<SS, true>(a, p, c0, tiles, strip);
    else w4a8_amx_block_t<SS, false>(a, p, c0, tiles, strip);
}
