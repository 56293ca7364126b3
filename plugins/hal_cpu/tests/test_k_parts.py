"""Small-M GEMVs with K cut into parts (csrc/parts.inl): every part count against the float64 reference, bits
that depend on the part count alone (never on threads or column tiles), and the rule choosing it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import pytest
from hal_cpu.ops import _rules, quantized_gemm

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference
#: 1 (no split), uneven splits of the groups, as many parts as groups, and more parts than groups (clamped).
PART_COUNTS = [1, 2, 3, 8, 1000]


@pytest.mark.parametrize("k_parts", PART_COUNTS)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("k", "group_size"), [(1024, 128), (384, 96), (256, 32)])
def test_w4a16_k_parts_match_reference(variant: str, rng: np.random.Generator, k_parts: int, m: int, dtype: str,
                                       k: int, group_size: int) -> None:
    """The W4A16 sweep in parts of whole groups (8, 4 and 8 groups), over a ragged column tail (300 columns)."""
    args = quantized_gemm_inputs(rng, m=m, k=k, n=300, bits=4, group_size=group_size, symmetric=False,
                                 dtype=dtype)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=2, k_parts=k_parts)
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32",
                 what=f"{variant} W4A16 M={m} G={group_size} {dtype} x, {k_parts} parts of K")


@pytest.mark.parametrize("k_parts", PART_COUNTS)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize(("group_size", "act_order"), [(128, False), (32, False), (64, True)])
def test_w8a8_k_parts_match_reference(variant: str, rng: np.random.Generator, k_parts: int, m: int,
                                      group_size: int, act_order: bool) -> None:
    """The W8A8 small-M kernels in parts of whole segments, act-order included, over a ragged column tail."""
    args = quantized_gemm_inputs(rng, m=m, k=1024, n=300, bits=8, group_size=group_size, symmetric=False,
                                 dtype="fp16", act_order=act_order)
    got = quantized_gemm.gemm(args["x"], args["qweight"], threads=2, k_parts=k_parts)
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32",
                 what=f"{variant} W8A8 M={m} G={group_size} act_order={act_order}, {k_parts} parts of K")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("k_parts", [2, 3, 8])
def test_k_parts_bits_depend_on_the_part_count_alone(rng: np.random.Generator, bits: int, dtype: str,
                                                      k_parts: int) -> None:
    """For one part count, thread counts and column tiles never change a value (the parts are added in order)."""
    args = quantized_gemm_inputs(rng, m=1, k=1024, n=700, bits=bits, group_size=128, symmetric=False, dtype=dtype)
    kernel = "registers" if bits == 4 else None
    serial = quantized_gemm.gemm(args["x"], args["qweight"], kernel=kernel, threads=1, n_tile=64, k_parts=k_parts)
    for threads, n_tile in [(1, 4096), (2, 128), (3, 64), (2, None), (4, 192)]:
        got = quantized_gemm.gemm(args["x"], args["qweight"], kernel=kernel, threads=threads, n_tile=n_tile,
                                  k_parts=k_parts)
        np.testing.assert_array_equal(got, serial, err_msg=f"threads={threads} n_tile={n_tile}")


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k_parts", [2, 8])
def test_w8a8_k_parts_simd_variants_agree_bit_for_bit(select_isa: Callable[[str], AbstractContextManager[None]],
                                                      rng: np.random.Generator, m: int, k_parts: int) -> None:
    """The byte-dot-product and float W8A8 kernels cut K alike, so they still give the same bits."""
    args = quantized_gemm_inputs(rng, m=m, k=1024, n=200, bits=8, group_size=64, symmetric=False, dtype="fp32")
    got = {}
    for name in ("avx512vnni", "avx512"):
        with select_isa(name):
            got[name] = quantized_gemm.gemm(args["x"], args["qweight"], threads=2, k_parts=k_parts)
    np.testing.assert_array_equal(got["avx512vnni"], got["avx512"])


def test_k_parts_rule() -> None:
    """K is cut (into K_PARTS) only for small M and packed rows shorter than K_PART_ROW_BYTES; never by host."""
    parts = _rules.K_PARTS
    assert _rules.gemv_k_parts(4096, 4, 1) == parts  # 16 KiB int4 rows
    assert _rules.gemv_k_parts(11008, 4, 1) == 1  # 43 KiB: the column ranges are long already
    assert _rules.gemv_k_parts(4096, 4, 2) == 1  # W4A16 cuts K only at M = 1
    assert _rules.gemv_k_parts(4096, 8, 2) == parts and _rules.gemv_k_parts(11008, 8, 1) == parts
    assert _rules.gemv_k_parts(_rules.K_PART_ROW_BYTES, 8, 1) == 1
    assert _rules.gemv_k_parts(4096, 8, _rules.SWEEP_M_MAX + 1) == 1
    # With as many parts as threads a task owns whole rows; with more threads, ranges of a part.
    assert _rules.gemv_column_tile(4096, 2, 1, parts) == 4096
    assert _rules.gemv_column_tile(4096, 16, 1, parts) == 2048
    assert quantized_gemm.w8a8_column_tile(4096, 2, 1, parts) == 4096
    assert quantized_gemm.w8a8_column_tile(4096, 32, 1, parts) == 1024
