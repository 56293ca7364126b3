// w8a8_amx.inl: included by w8a8_vnni.inl in the avx512vnni variant; not a standalone header.
// ---------------------------------------------------------------------------------------------
// W8A8 for many rows on AMX-INT8 tiles: tdpbsud multiplies 16 rows x 64 bytes of quantised
// activations (signed) by 64 x 16 codes (unsigned) into 16 x 16 int32 sums, exactly.
//
// The codes are the large-M kernel's packed panels ([rows / 4][64 columns][4] bytes per chunk of
// segments, w8_pack_block): 16 consecutive 4-row steps of 16 columns are a B tile as they stand
// (64 bytes per step, stride 256). The activations are copied once per call from the panel
// [m, kp] into contiguous 1 KiB A tiles (rows padded to 32 with zeros). Each segment's 2 x 2 C
// tiles are stored and applied with w8_accumulate, the vector kernel's epilogue, segment after
// segment: the same integer sums and float operations, so the same bits.
//
// Applies with AMX-INT8 and the OS's permission (attention_amx.inl; HAL_CPU_AMX=0 turns it off),
// at least kW8a8AmxMinRows rows, no act-order permutation, and every segment a multiple of 64 rows
// (group sizes that are multiples of 64).
// ---------------------------------------------------------------------------------------------

//: Fewest rows for the tile path.
constexpr int64_t kW8a8AmxMinRows = 32;

inline bool w8a8_amx_applies(const hal_cpu_w8a8_gemm_args &a, const W8Panel &p, int64_t nseg) {
    if (a.m < kW8a8AmxMinRows || a.perm || !hal_cpu_attention_amx_allowed() || !amx_int8_usable()) return false;
    for (int64_t sg = 0; sg < nseg; ++sg)
        if ((p.pstart[sg + 1] - p.pstart[sg]) % 64) return false;
    return true;
}

// The panel's rows as A tiles: [rows / 16][kp / 64][16][64] bytes, rows past m zero.
inline std::vector<int8_t> w8_amx_tiles(const W8Panel &p, int64_t m, int32_t threads) {
    const int64_t kp = p.kp, steps = kp / 64, row_tiles = (m + 31) / 32 * 2;
    std::vector<int8_t> tiles(size_t(row_tiles) * 16 * kp, 0);
    parallel_for(row_tiles, threads, [&](int64_t rt) {
        for (int64_t r = 0; r < 16 && rt * 16 + r < m; ++r)
            for (int64_t s = 0; s < steps; ++s)
                std::memcpy(tiles.data() + ((rt * steps + s) * 16 + r) * 64, p.q.data() + (rt * 16 + r) * kp + s * 64,
                            64);
    });
    return tiles;
}

// y for rows r0 .. r0 + 15 (below m) x 16 columns at col, from one C tile of segment sg.
template <class SS>
HAL_AMX_INT8 inline void w8_amx_apply(const W8Panel &p, const std::vector<Segment> &segs, int64_t sg,
                                      const W8Weight<SS> &w, const int32_t *c, int64_t m, int64_t r0, int64_t col,
                                      __mmask16 mask, float *y) {
    const int64_t nseg = int64_t(segs.size()), rows = std::min<int64_t>(16, m - r0);
    const V::f s = w.scale(segs[sg].group, col, mask), z = w.zero(segs[sg].group, col, mask);
    for (int64_t rr = 0; rr < rows; ++rr) {
        const int64_t r = r0 + rr;
        w8_accumulate(_mm512_loadu_si512(c + 16 * rr), s, z, p.sum[r * nseg + sg], sg == 0, y + r * w.n + col, mask);
    }
}

// Every row x one packed 64-column panel (columns [c0, c0 + valid)) over segments [s0, s1).
template <class SS>
HAL_AMX_INT8 void w8_amx_panel(const W8Panel &p, const std::vector<Segment> &segs, int64_t s0, int64_t s1,
                               const W8Weight<SS> &w, const uint8_t *panel, const int8_t *tiles, int64_t m,
                               int64_t c0, int64_t valid, float *y) {
    const int64_t kp = p.kp;
    alignas(64) int32_t c[4][256];
    amx_configure();
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
        const bool two = m - r0 > 16;
        const int8_t *a0 = tiles + r0 * kp, *a1 = a0 + 16 * kp;  // row tiles r0 / 16 and the next
        for (int64_t sg = s0; sg < s1; ++sg) {
            const int64_t start = p.pstart[sg], steps = (p.pstart[sg + 1] - start) / 64;
            const uint8_t *b0 = panel + (start - p.pstart[s0]) * 64;
            for (int64_t cb = 0; cb < 4 && 16 * cb < valid; cb += 2) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; ++s) {
                    const uint8_t *b = b0 + s * 4096 + cb * 64;
                    _tile_loadd(4, a0 + (start + 64 * s) * 16, 64);
                    _tile_loadd(6, b, 256);
                    _tile_loadd(7, b + 64, 256);
                    _tile_dpbsud(0, 4, 6);
                    _tile_dpbsud(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a1 + (start + 64 * s) * 16, 64);
                        _tile_dpbsud(2, 5, 6);
                        _tile_dpbsud(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                if (two) {
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                }
                HAL_AMX_BARRIER();
                for (int64_t h = 0; h < 2; ++h) {
                    const __mmask16 mask = w8_lanes(valid - 16 * (cb + h));
                    if (!mask) break;
                    const int64_t col = c0 + 16 * (cb + h);
                    w8_amx_apply<SS>(p, segs, sg, w, c[h], m, r0, col, mask, y);
                    if (two) w8_amx_apply<SS>(p, segs, sg, w, c[2 + h], m, r0 + 16, col, mask, y);
                }
            }
        }
    }
}
