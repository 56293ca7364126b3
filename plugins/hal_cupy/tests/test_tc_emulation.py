"""The host emulation of the warp matrix instructions against the PTX ISA's fragment layouts.

``host_compiled/mma_host.cuh`` implements ``mma.sync`` (m16n8k16 and m16n8k8 f16/bf16, m16n8k32 s8), ``ldmatrix`` and
``cp.async`` for the host-compiled kernels.  These tests rebuild every lane's fragments independently, from the
element-indexed layout formulas as the PTX ISA states them ("Matrix Fragments for mma.m16n8k16 with floating point
type", "... for mma.m16n8k32", "ldmatrix"), and compare what each lane receives; a full tile product (cp.async ->
ldmatrix -> mma) is compared with numpy float64.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hal_cupy.testing import missing_compiler
from host_compiled.harness import HostKernelBuilder, toolchain_problem

from hal_core.arrays import BFLOAT16

WARPS = 2  # the probes run two warps; each must combine only its own lanes


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    problem = toolchain_problem(tmp_path_factory.mktemp("tc_probe"))
    if problem is not None:
        missing_compiler(f"host-compiled kernels unavailable: {problem}")
    yield HostKernelBuilder(tmp_path_factory.mktemp("tc_build")).build_mma_probe()


def _ptr(a: np.ndarray) -> int:
    assert a.flags.c_contiguous
    return a.ctypes.data


# --- The ISA's tables, element by element: (lane, element index) -> (row, col) ---------------------------------


def _f16_a(lane: int, i: int) -> tuple[int, int]:
    """A of m16n8k16 .f16/.bf16: elements a0..a7 (two per register)."""
    group, tig = lane >> 2, lane % 4
    row = group if (i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) if i < 4 else tig * 2 + (i & 1) + 8
    return row, col


def _f16_b(lane: int, i: int) -> tuple[int, int]:
    """B of m16n8k16: elements b0..b3."""
    group, tig = lane >> 2, lane % 4
    row = tig * 2 + (i & 1) if i < 2 else tig * 2 + (i & 1) + 8
    return row, group


def _f16_a8(lane: int, i: int) -> tuple[int, int]:
    """A of m16n8k8 .f16/.bf16: elements a0..a3 (two per register)."""
    group, tig = lane >> 2, lane % 4
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)


def _f16_b8(lane: int, i: int) -> tuple[int, int]:
    """B of m16n8k8: elements b0, b1."""
    group, tig = lane >> 2, lane % 4
    return tig * 2 + (i & 1), group


def _acc(lane: int, i: int) -> tuple[int, int]:
    """C/D (f32 or s32) of m16n8k16 and m16n8k32: elements c0..c3."""
    group, tig = lane >> 2, lane % 4
    row = group if i < 2 else group + 8
    return row, tig * 2 + (i & 1)


def _s8_a(lane: int, i: int) -> tuple[int, int]:
    """A of m16n8k32 .s8: elements a0..a15 (four per register)."""
    group, tig = lane >> 2, lane % 4
    row = group if (i < 4 or 8 <= i < 12) else group + 8
    col = tig * 4 + (i & 3) if i < 8 else tig * 4 + (i & 3) + 16
    return row, col


def _s8_b(lane: int, i: int) -> tuple[int, int]:
    """B of m16n8k32 .s8: elements b0..b7."""
    group, tig = lane >> 2, lane % 4
    row = tig * 4 + (i & 3) if i < 4 else tig * 4 + (i & 3) + 16
    return row, group


def _pack(bits: np.ndarray, table, elems: int, per_reg: int) -> np.ndarray:
    """Per-lane registers [32, elems // per_reg] of a matrix given as unsigned bit patterns, via ``table``."""
    width = 32 // per_reg
    regs = np.zeros((32, elems // per_reg), dtype=np.uint32)
    for lane in range(32):
        for i in range(elems):
            r, c = table(lane, i)
            regs[lane, i // per_reg] |= np.uint32(int(bits[r, c]) << (width * (i % per_reg)))
    return regs


def _b16_bits(values: np.ndarray, bf16: bool) -> np.ndarray:
    return (values.astype(BFLOAT16) if bf16 else values.astype(np.float16)).view(np.uint16)


def _b16_values(values: np.ndarray, bf16: bool) -> np.ndarray:
    return (values.astype(BFLOAT16) if bf16 else values.astype(np.float16)).astype(np.float64)


# --- mma.sync -----------------------------------------------------------------------------------------------------


def _check_b16_mma(probe_fn: Any, rng: np.random.Generator, bf16: bool, k: int, a_map: Any, b_map: Any) -> None:
    """mma.sync m16n8k``k`` with fp16/bf16 inputs through ``probe_fn``: A and B packed by the ISA's fragment
    tables ``a_map``/``b_map``, C by the accumulator table; every lane's D against the float64 product."""
    mats = [(rng.standard_normal((16, k)), rng.standard_normal((k, 8)), rng.standard_normal((16, 8)))
            for _ in range(WARPS)]
    a_regs = np.concatenate([_pack(_b16_bits(a, bf16), a_map, k // 2, 2) for a, _, _ in mats])
    b_regs = np.concatenate([_pack(_b16_bits(b, bf16), b_map, k // 4, 2) for _, b, _ in mats])
    c_frag = np.zeros((32 * WARPS, 4), dtype=np.float32)
    for w, (_, _, c) in enumerate(mats):
        for lane in range(32):
            for i in range(4):
                c_frag[32 * w + lane, i] = np.float32(c[_acc(lane, i)])
    d_frag = np.zeros_like(c_frag)
    assert probe_fn(_ptr(a_regs), _ptr(b_regs), _ptr(c_frag), _ptr(d_frag), int(bf16)) == 0
    for w, (a, b, c) in enumerate(mats):
        expected = _b16_values(a, bf16) @ _b16_values(b, bf16) + c.astype(np.float32).astype(np.float64)
        for lane in range(32):
            for i in range(4):
                # one rounding of the exact sum: agrees with float32(expected) to 1 ulp of float32
                np.testing.assert_allclose(d_frag[32 * w + lane, i], expected[_acc(lane, i)], rtol=2**-23, atol=1e-6,
                                           err_msg=f"warp {w} lane {lane} d{i}")


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_mma_m16n8k16_fragments(probe: ctypes.CDLL, host_rng: np.random.Generator, bf16: bool) -> None:
    """m16n8k16 (the GEMMs and the scores): every lane's D from the ISA's A/B/C tables, against float64."""
    _check_b16_mma(probe.probe_mma_m16n8k16, host_rng, bf16, 16, _f16_a, _f16_b)


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_mma_m16n8k8_fragments(probe: ctypes.CDLL, host_rng: np.random.Generator, bf16: bool) -> None:
    """m16n8k8 (the P V step of 8-token warps): every lane's D from the ISA's A/B/C tables, against float64."""
    _check_b16_mma(probe.probe_mma_m16n8k8, host_rng, bf16, 8, _f16_a8, _f16_b8)


def test_mma_m16n8k32_s8_fragments(probe: ctypes.CDLL, host_rng: np.random.Generator) -> None:
    mats = [(host_rng.integers(-128, 128, (16, 32)), host_rng.integers(-128, 128, (32, 8)),
             host_rng.integers(-2**20, 2**20, (16, 8))) for _ in range(WARPS)]
    a_regs = np.concatenate([_pack(a.astype(np.int8).view(np.uint8), _s8_a, 16, 4) for a, _, _ in mats])
    b_regs = np.concatenate([_pack(b.astype(np.int8).view(np.uint8), _s8_b, 8, 4) for _, b, _ in mats])
    c_frag = np.zeros((32 * WARPS, 4), dtype=np.int32)
    for w, (_, _, c) in enumerate(mats):
        for lane in range(32):
            for i in range(4):
                c_frag[32 * w + lane, i] = c[_acc(lane, i)]
    d_frag = np.zeros_like(c_frag)
    assert probe.probe_mma_m16n8k32_s8(_ptr(a_regs), _ptr(b_regs), _ptr(c_frag), _ptr(d_frag)) == 0
    for w, (a, b, c) in enumerate(mats):
        expected = a @ b + c
        got = np.zeros((16, 8), dtype=np.int64)
        for lane in range(32):
            for i in range(4):
                got[_acc(lane, i)] = d_frag[32 * w + lane, i]
        np.testing.assert_array_equal(got, expected, err_msg=f"warp {w}")


def test_mma_s8_wraps_like_s32(probe: ctypes.CDLL) -> None:
    """Accumulation wraps modulo 2**32, as .s32 does: C = INT32_MAX plus one positive product."""
    a = np.zeros((16, 32), dtype=np.int64)
    b = np.zeros((32, 8), dtype=np.int64)
    a[0, 0], b[0, 0] = 1, 1
    a_regs = np.concatenate([_pack(a.astype(np.int8).view(np.uint8), _s8_a, 16, 4)] * WARPS)
    b_regs = np.concatenate([_pack(b.astype(np.int8).view(np.uint8), _s8_b, 8, 4)] * WARPS)
    c_frag = np.full((32 * WARPS, 4), 2**31 - 1, dtype=np.int32)
    d_frag = np.zeros_like(c_frag)
    assert probe.probe_mma_m16n8k32_s8(_ptr(a_regs), _ptr(b_regs), _ptr(c_frag), _ptr(d_frag)) == 0
    assert d_frag[0, 0] == -(2**31)  # lane 0, d0 = (row 0, col 0)
    assert d_frag[0, 1] == 2**31 - 1


# --- ldmatrix -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_fragments(probe: ctypes.CDLL, host_rng: np.random.Generator, count: int, trans: bool) -> None:
    """Lane l gets, of matrix j, row l // 4 and columns 2 (l % 4) + {0, 1} (transposed: the same of the transpose).

    Row addresses are scattered (a random permutation of rows in a larger buffer), as only the address a lane
    supplies, never its position, may matter.
    """
    rows = 64 * WARPS
    buf = host_rng.integers(0, 2**16, (rows, 8), dtype=np.uint16)
    order = host_rng.permutation(rows)
    offsets = (order * 8).astype(np.int32)  # thread t supplies buffer row order[t]
    out = np.zeros((32 * WARPS, 4), dtype=np.uint32)
    assert probe.probe_ldmatrix(_ptr(buf), _ptr(offsets), count, int(trans), _ptr(out)) == 0
    for w in range(WARPS):
        for j in range(count):
            mat = np.stack([buf[order[32 * w + 8 * j + r]] for r in range(8)])  # the 8x8 matrix j of warp w
            if trans:
                mat = mat.T
            for lane in range(32):
                lo, hi = mat[lane // 4, 2 * (lane % 4)], mat[lane // 4, 2 * (lane % 4) + 1]
                assert out[32 * w + lane, j] == int(lo) | (int(hi) << 16), f"warp {w} matrix {j} lane {lane}"


# --- cp.async -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src_bytes", [0, 4, 16])
def test_cp_async_groups_complete_at_wait(probe: ctypes.CDLL, host_rng: np.random.Generator, src_bytes: int) -> None:
    """A group's bytes appear only once a wait_group retires it (oldest first); zero-fill past src_bytes."""
    src = host_rng.integers(0, 256, 48, dtype=np.uint8)
    old = host_rng.integers(0, 256, 48, dtype=np.uint8)
    dst = old.copy()
    seen = np.zeros((4, 48), dtype=np.uint8)
    assert probe.probe_cp_async(_ptr(src), _ptr(dst), src_bytes, _ptr(seen)) == 0
    group2 = np.concatenate([src[32:32 + src_bytes], np.zeros(16 - src_bytes, dtype=np.uint8)])
    after = [old.copy() for _ in range(4)]
    after[1][:16] = src[:16]
    after[2][:28] = src[:28]
    after[3][:28] = src[:28]
    after[3][32:] = group2
    for stage, expected in enumerate(after):
        np.testing.assert_array_equal(seen[stage], expected, err_msg=f"stage {stage}")
    np.testing.assert_array_equal(dst[28:32], old[28:32])  # bytes no copy covers stay untouched


# --- the whole pipeline on one tile --------------------------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_tile_product_matches_float64(probe: ctypes.CDLL, host_rng: np.random.Generator, bf16: bool) -> None:
    """cp.async staging, ldmatrix.x4 (A), ldmatrix.x2.trans (B) and mma: D = A @ B + C against numpy float64."""
    a = _b16_values(host_rng.standard_normal((16, 16)), bf16)
    b = _b16_values(host_rng.standard_normal((16, 8)), bf16)
    c = host_rng.standard_normal((16, 8)).astype(np.float32)
    d = np.zeros((16, 8), dtype=np.float32)
    a_bits = np.ascontiguousarray(_b16_bits(a, bf16))
    b_bits = np.ascontiguousarray(_b16_bits(b, bf16))
    assert probe.probe_tile_product(_ptr(a_bits), _ptr(b_bits), _ptr(c), _ptr(d), int(bf16)) == 0
    expected = a @ b + c.astype(np.float64)
    np.testing.assert_allclose(d, expected, rtol=2**-23, atol=1e-6)


# --- packed 16-bit arithmetic ----------------------------------------------------------------------------------------


def test_packed_b16_arithmetic(probe: ctypes.CDLL, host_rng: np.random.Generator) -> None:
    """fma.rn.{f16,bf16}x2 and sub.f16x2 round each lane once to nearest even; LOP3 0xEA is (a & b) | c."""
    n = 256
    for op, bf16 in ((0, False), (1, True), (2, False)):
        vals = [host_rng.standard_normal((n, 2)) * 4 for _ in range(3)]
        bits = [_b16_bits(v, bf16) for v in vals]
        regs = [np.ascontiguousarray(bt[:, 0].astype(np.uint32) | (bt[:, 1].astype(np.uint32) << 16)) for bt in bits]
        r = np.zeros(n, dtype=np.uint32)
        probe.probe_b16x2(op, _ptr(regs[0]), _ptr(regs[1]), _ptr(regs[2]), _ptr(r), n)
        x, y, z = (_b16_values(v, bf16) for v in vals)
        exact = x * y + z if op < 2 else x - y
        want = _b16_bits(exact, bf16)  # numpy: one round-to-nearest-even from float64
        got = np.stack([r & 0xFFFF, r >> 16], axis=1).astype(np.uint16)
        np.testing.assert_array_equal(got, want, err_msg=f"op {op}")
    a, b, c = (host_rng.integers(0, 2**32, n, dtype=np.uint32) for _ in range(3))
    r = np.zeros(n, dtype=np.uint32)
    probe.probe_b16x2(3, _ptr(a), _ptr(b), _ptr(c), _ptr(r), n)
    np.testing.assert_array_equal(r, (a & b) | c)
