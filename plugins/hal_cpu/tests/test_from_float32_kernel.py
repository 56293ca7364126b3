"""The compiled float32 -> fp16/bf16 rounding that finishes large results: numpy's bits on every variant and thread
count, special values included, and the ops' outputs through it equal to numpy's cast of the same float32 result."""

from __future__ import annotations

import hal_cpu
import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import _common, quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.quant import quantize

DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(BFLOAT16)}


def _specials(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random magnitudes across float32's range, with ties, subnormals, overflow, infinities and NaNs mixed in."""
    with np.errstate(over="ignore"):
        values = (rng.standard_normal(n) * 2.0 ** rng.integers(-140, 120, n)).astype(np.float32)
    bits = values.view(np.uint32)
    ties = rng.random(n) < 0.1  # exactly half-way between two bf16 (low 16 bits 0x8000) or fp16 neighbours
    bits[ties] = (bits[ties] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    halfway16 = rng.random(n) < 0.05
    bits[halfway16] = (bits[halfway16] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65520.0, 65519.0, 1e-45, -1e-45,
                         1.1754942e-38, 5.96e-8, 2.98e-8, 3.4028235e38], dtype=np.float32)
    where = rng.integers(0, n, specials.size)
    values[where] = specials
    signalling = rng.integers(0, n, 8)  # NaNs with payloads, signalling ones too
    bits[signalling] = np.uint32(0x7F800001) + rng.integers(0, 1 << 22, 8).astype(np.uint32)
    return values


def _same_bits(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    g, e = got.view(np.uint16), expected.view(np.uint16)
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(g[~nan], e[~nan])
    if dtype == "bf16":  # ml_dtypes gives the quiet NaN of the sign for every NaN
        np.testing.assert_array_equal(g[nan], e[nan])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [None, 5_637, 100_003, 3 * _common.NARROW_CHUNK + 17])
def test_rounding_gives_numpys_bits(variant: str, rng: np.random.Generator, dtype: str, n: int | None) -> None:
    """Every element as numpy's astype rounds it (nearest even), tails past the vector width and chunk included
    (None: the smallest result the kernel rounds)."""
    values = _specials(rng, _common.NARROW_NATIVE_MIN[np.dtype(DTYPES[dtype])] if n is None else n)
    got = _common.narrow(values, DTYPES[dtype])
    assert got.dtype == DTYPES[dtype] and got.shape == values.shape
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(DTYPES[dtype])
    _same_bits(got, expected, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_threads_and_shapes(native: _native.Native, rng: np.random.Generator, dtype: str) -> None:
    """One thread and two give the same bits; a 2-D result keeps its shape; a non-contiguous one takes astype."""
    values = _specials(rng, 300 * 257).reshape(300, 257)
    previous = hal_cpu.set_threads(2)
    try:
        two = _common.narrow(values, DTYPES[dtype])
        hal_cpu.set_threads(1)
        assert native.threads == 1
        one = _common.narrow(values, DTYPES[dtype])
    finally:
        hal_cpu.set_threads(previous)
    np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))
    assert one.shape == (300, 257)
    strided = values[:, ::2]
    with np.errstate(over="ignore", invalid="ignore"):
        _same_bits(_common.narrow(strided, DTYPES[dtype]), strided.astype(DTYPES[dtype]), dtype)


def test_small_and_other_results_take_astype(rng: np.random.Generator) -> None:
    """Below the threshold, float32 targets and float16 inputs: numpy's cast (the same array when nothing changes)."""
    small = rng.standard_normal(100).astype(np.float32)
    np.testing.assert_array_equal(_common.narrow(small, BFLOAT16).view(np.uint16),
                                  small.astype(BFLOAT16).view(np.uint16))
    big = rng.standard_normal(max(_common.NARROW_NATIVE_MIN.values())).astype(np.float32)
    assert _common.narrow(big, np.float32) is big


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_prompt_sized_gemm_result_is_numpys_cast_of_its_float32_result(rng: np.random.Generator,
                                                                           dtype: str) -> None:
    """quantized_gemm on 64 rows of fp16/bf16: its output equals numpy's cast of the same kernel's float32 result."""
    x = rng.standard_normal((64, 256)).astype(DTYPES[dtype])
    weight = quantize(rng.standard_normal((256, 1024)), bits=4, group_size=64)
    f32 = quantized_gemm.gemm(x, weight, kernel="blocked")
    assert f32.dtype == np.float32 and f32.size >= _common.NARROW_NATIVE_MIN[np.dtype(DTYPES[dtype])]
    _same_bits(_common.narrow(f32, DTYPES[dtype]), f32.astype(DTYPES[dtype]), dtype)
