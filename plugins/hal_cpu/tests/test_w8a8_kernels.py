"""The compiled W8A8 quantized_gemm kernels: act-order runs, SIMD variants bit for bit, tilings, threads, non-finite
rows and the large-M blocks (the float64 reference and W4A16's kernels: test_gemm_kernels.py)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import pytest
from hal_cpu.ops import quantized_gemm

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference


def _uneven_act_order(rng: np.random.Generator, m: int, k: int, n: int, group_size: int) -> dict:
    """Act-order W8A8 inputs whose groups hold uneven row counts (runs not a multiple of 4, some empty)."""
    from hal_core.quant import QuantizedWeight

    args = quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=8, group_size=group_size, symmetric=False, dtype="fp32")
    qw = args["qweight"]
    g_idx = rng.integers(0, k // group_size, size=k).astype(np.int32)
    args["qweight"] = QuantizedWeight(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.shape, g_idx=g_idx)
    return args


@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 13])
def test_w8a8_uneven_act_order_runs(variant: str, rng: np.random.Generator, m: int) -> None:
    """Act-order groups of any length (the int8 panel pads each to a multiple of 4 rows with zeros)."""
    args = _uneven_act_order(rng, m, 320, 131, 32)
    assert_close(quantized_gemm.gemm(args["x"], args["qweight"]), REFERENCE(args), kind="gemm", dtype="fp32",
                 what=f"{variant} W8A8 uneven act-order")


def _w8a8_case(rng: np.random.Generator, m: int, case: str) -> dict:
    """Inputs for the bit-for-bit tests: group sizes, act-order, half scales and activations, odd segments."""
    from hal_core.arrays import BFLOAT16

    if case == "act-order":
        return _uneven_act_order(rng, m, 256, 200, 32)
    if case == "odd-segments":  # 999-row groups: segments of 512 and 487 rows; columns past the last 8
        return quantized_gemm_inputs(rng, m=m, k=1998, n=75, bits=8, group_size=999, symmetric=False, dtype="fp32")
    args = quantized_gemm_inputs(rng, m=m, k=1024 if case == "g1024" else 256, n=200, bits=8,
                                 group_size=1024 if case == "g1024" else 32, symmetric=case != "g32",
                                 dtype="fp16" if case == "fp16-x" else "fp32")
    if case == "bf16-scales":
        qw = args["qweight"]
        args["qweight"] = replace(qw, scales=np.asarray(qw.scales).astype(BFLOAT16))
    return args


W8A8_CASES = ["g32", "g1024", "act-order", "bf16-scales", "fp16-x", "odd-segments"]


@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 12, 40])
@pytest.mark.parametrize("case", W8A8_CASES)
def test_w8a8_simd_variants_agree_bit_for_bit(select_isa: Callable[[str], AbstractContextManager[None]],
                                              rng: np.random.Generator, m: int, case: str) -> None:
    """The byte-dot-product kernel (avx512vnni) gives the AVX-512 float kernel's bits: both sum each segment
    exactly and apply the same float operations in the same order (docs/quantization.md)."""
    args = _w8a8_case(rng, m, case)
    got = {}
    for name in ("avx512vnni", "avx512"):
        with select_isa(name):
            got[name] = quantized_gemm.gemm(args["x"], args["qweight"])
    np.testing.assert_array_equal(got["avx512vnni"], got["avx512"])
    assert_close(got["avx512vnni"], REFERENCE(args), kind="gemm", dtype="fp16" if case == "fp16-x" else "fp32",
                 what=f"avx512vnni W8A8 {case}")


@pytest.mark.parametrize("m", [2, 3, 4, 7, 8, 13, 14, 16, 19, 40])
@pytest.mark.parametrize("case", W8A8_CASES)
def test_w8a8_rows_together_give_each_rows_bits(variant: str, rng: np.random.Generator, m: int, case: str) -> None:
    """Many rows in one call (the integer row tiles: int16 pairs on avx2 and on avx512 without VNNI from 2 rows,
    widened once per segment from 16; byte dot products on avx512vnni) give each row's bits alone (M = 1: the
    swept float sums on avx2 and avx512), K in one part: every kernel of a variant sums each segment exactly and
    applies the same float epilogue."""
    args = _w8a8_case(rng, m, case)
    together = quantized_gemm.gemm(args["x"], args["qweight"], k_parts=1)
    alone = np.concatenate([quantized_gemm.gemm(args["x"][r:r + 1], args["qweight"], k_parts=1) for r in range(m)])
    np.testing.assert_array_equal(together, alone)
    assert_close(together, REFERENCE(args), kind="gemm", dtype="fp16" if case == "fp16-x" else "fp32",
                 what=f"{variant} W8A8 {case} M={m}")


@pytest.mark.parametrize("m", [1, 4, 9])
def test_w8a8_tiling_and_threads_agree(variant: str, rng: np.random.Generator, m: int) -> None:
    """W8A8 column tiles and thread counts never change a value (small-M and large-M kernels)."""
    args = quantized_gemm_inputs(rng, m=m, k=384, n=300, bits=8, group_size=128, symmetric=False, dtype="fp32")
    serial = quantized_gemm.gemm(args["x"], args["qweight"], threads=1, n_tile=64)
    for threads, n_tile in [(2, 128), (3, 64), (2, 4096)]:
        got = quantized_gemm.gemm(args["x"], args["qweight"], threads=threads, n_tile=n_tile)
        np.testing.assert_array_equal(got, serial)
    assert_close(serial, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W8A8 tiles")


@pytest.mark.parametrize("m", [1, 2, 4])
def test_w8a8_widest_small_m_tiles(variant: str, rng: np.random.Generator, m: int) -> None:
    """Small-M W8A8 tasks as wide as the accumulators allow (8192 / M columns, more asked for is clamped):
    the same bits as narrow tasks, and the reference's values."""
    n = quantized_gemm.W8A8_ACC_WORDS // m + 100
    args = quantized_gemm_inputs(rng, m=m, k=256, n=n, bits=8, group_size=128, symmetric=False, dtype="fp16")
    narrow = quantized_gemm.gemm(args["x"], args["qweight"], threads=2, n_tile=64)
    for n_tile in (None, quantized_gemm.W8A8_ACC_WORDS // m, 10**6):
        got = quantized_gemm.gemm(args["x"], args["qweight"], threads=2, n_tile=n_tile)
        np.testing.assert_array_equal(got, narrow, err_msg=f"n_tile={n_tile}")
    assert_close(narrow, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W8A8 wide tiles M={m}")


@pytest.mark.parametrize("m", [3, 9])
def test_w8a8_non_finite_rows_both_kernels(variant: str, rng: np.random.Generator, m: int) -> None:
    """NaN/Inf rows give NaN rows in the small-M and the large-M kernel; the other rows match the reference."""
    args = quantized_gemm_inputs(rng, m=m, k=256, n=90, bits=8, group_size=64, symmetric=False, dtype="fp32")
    clean = REFERENCE(args)
    bad = [0, m - 1]
    args["x"][0, 5] = np.inf
    args["x"][m - 1, 200] = np.nan
    got = quantized_gemm.gemm(args["x"], args["qweight"])
    assert np.isnan(got[bad]).all()
    rows = [r for r in range(m) if r not in bad]
    assert_close(got[rows], clean[rows], kind="gemm", dtype="fp32", what=f"{variant} W8A8 finite rows")


def test_w8a8_column_tile_rule() -> None:
    """Wide small-M W8A8 tasks, a multiple of the thread count, never past the kernel's widest tile."""
    for m in (1, 2, 3, 4):
        widest = quantized_gemm.W8A8_ACC_WORDS // m // 64 * 64
        for n, threads in [(11008, 2), (4096, 2), (77, 2), (4096, 1), (11008, 16), (100000, 3)]:
            tile = quantized_gemm.w8a8_column_tile(n, threads, m)
            assert tile % 64 == 0 and 64 <= tile <= widest
            tasks = -(-n // tile)
            assert tasks >= min(threads, -(-n // 64)), (n, threads, tile)
    assert quantized_gemm.w8a8_column_tile(11008, 2, 1) == 5504  # M = 1: one long range per thread


@pytest.mark.parametrize("m", [5, 8, 16, 64])
@pytest.mark.parametrize("case", ["g128", "act-order"])
def test_w8a8_large_m_blocks_and_chunks(select_isa: Callable[[str], AbstractContextManager[None]],
                                        rng: np.random.Generator, m: int, case: str) -> None:
    """The larger-M byte-dot-product kernel across its blocks: K in several chunks of whole segments (the last one
    short), N over several 512-column blocks with a ragged last panel, act-order groups of uneven length; the
    float kernel's bits and the reference's values."""
    args = (_uneven_act_order(rng, m, 1216, 1100, 32) if case == "act-order" else
            quantized_gemm_inputs(rng, m=m, k=1280, n=1100, bits=8, group_size=128, symmetric=False, dtype="bf16"))
    got = {}
    for name in ("avx512vnni", "avx512"):
        with select_isa(name):
            got[name] = quantized_gemm.gemm(args["x"], args["qweight"])
    np.testing.assert_array_equal(got["avx512vnni"], got["avx512"])
    assert_close(got["avx512vnni"], REFERENCE(args), kind="gemm", dtype="bf16" if case == "g128" else "fp32",
                 what=f"avx512vnni W8A8 M={m} {case}")


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_w8a8_large_m_more_threads_than_panels(variant: str, rng: np.random.Generator, threads: int) -> None:
    """More threads than 64-column panels (some column blocks empty): every column once, the reference's values,
    the bits of one thread."""
    args = quantized_gemm_inputs(rng, m=7, k=384, n=40, bits=8, group_size=128, symmetric=False, dtype="fp32")
    serial = quantized_gemm.gemm(args["x"], args["qweight"], threads=1)
    np.testing.assert_array_equal(quantized_gemm.gemm(args["x"], args["qweight"], threads=threads), serial)
    assert_close(serial, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W8A8 M=7 N=40")
