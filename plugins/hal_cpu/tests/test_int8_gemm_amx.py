"""W4A8 and W8A8 on AMX-INT8 tiles (csrc/w4a8_amx.inl, csrc/w8a8_amx.inl): the bits of the vector kernels, for
every shape the tile paths take."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import quantize_activations
from hal_core.testing.inputs import quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference


@pytest.fixture
def amx() -> Iterator[_native.Native]:
    """The library with AMX allowed; skips (saying why) where the selected variant, CPU or OS has no AMX-INT8."""
    native = _native.load()
    previous = native.lib.hal_cpu_set_attention_amx(1)
    try:
        if not native.lib.hal_cpu_gemm_amx():
            pytest.skip(f"W4A8 runs on vector dot products here (variant {native.isa!r}: no AMX-INT8 tiles, or the "
                        "OS refused the tile state)")
        yield native
    finally:
        native.lib.hal_cpu_set_attention_amx(previous)


def _both(native: _native.Native, x: np.ndarray, qweight, threads: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tile path, vector path) results of the same call (int4 weights as W4A8, int8 ones as W8A8)."""
    tiles = quantized_gemm.gemm(x, qweight, activations="int8", threads=threads)
    native.lib.hal_cpu_set_attention_amx(0)
    try:
        assert native.lib.hal_cpu_gemm_amx() == 0
        vector = quantized_gemm.gemm(x, qweight, activations="int8", threads=threads)
    finally:
        native.lib.hal_cpu_set_attention_amx(1)
    return tiles, vector


@pytest.mark.parametrize(("m", "k", "n", "group"), [(16, 256, 32, 64), (20, 512, 600, 128), (32, 256, 32, 64),
                                                   (33, 512, 83, 128), (47, 1024, 200, 256), (100, 640, 300, 64),
                                                   (64, 2048, 130, 2048)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiles_give_the_vector_kernels_bits(amx: _native.Native, m: int, k: int, n: int, group: int,
                                            symmetric: bool, threads: int) -> None:
    """Row tiles of 32 with a partial last one, column tails past the last 32, several K chunks, zero points or
    not: bit for bit the vector kernel, and within float32 rounding of the float64 W4A8 reference."""
    seed = m * 1000 + n + group + symmetric
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    args = quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=4, group_size=group, symmetric=symmetric, dtype="fp32")
    tiles, vector = _both(amx, args["x"], args["qweight"], threads)
    np.testing.assert_array_equal(tiles.view(np.uint32), vector.view(np.uint32))
    expected = REFERENCE({**args, "activations": "int8"})
    xq, sx = quantize_activations(args["x"])
    magnitude = np.abs(xq.astype(np.float64)) @ np.abs(args["qweight"].dequantize(np.float64))
    bound = (2 * (k // group) + 2) * 2.0**-24 * sx.astype(np.float64)[:, None] * magnitude + 1e-30
    assert (np.abs(tiles - expected) <= bound).all()


@pytest.mark.parametrize("case", ["fp16-x", "bf16-x", "bf16-scales", "fp32-scales", "zero-point-15"])
def test_dtypes_and_zero_points_give_the_vector_bits(amx: _native.Native, case: str) -> None:
    """Activation and scale dtypes, and the largest zero point an int4 code has, on the tile path."""
    seed = sum(map(ord, case))
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    dtype = {"fp16-x": "fp16", "bf16-x": "bf16"}.get(case, "fp32")
    args = quantized_gemm_inputs(rng, m=40, k=512, n=96, bits=4, group_size=128, symmetric=case != "zero-point-15",
                                 dtype=dtype)
    qw = args["qweight"]
    if case.endswith("scales"):
        qw = replace(qw, scales=np.asarray(qw.scales).astype(BFLOAT16 if case == "bf16-scales" else np.float32))
    if case == "zero-point-15":
        qw = replace(qw, zeros=np.full_like(np.asarray(qw.zeros), 15))
    tiles, vector = _both(amx, args["x"], qw, None)
    np.testing.assert_array_equal(tiles.view(np.uint32), vector.view(np.uint32))


def test_non_finite_rows_are_nan_on_the_tile_path(amx: _native.Native) -> None:
    """NaN / inf rows give NaN rows, the others the bits of a run without them."""
    rng = np.random.default_rng(7)
    print("seed=7")
    args = quantized_gemm_inputs(rng, m=48, k=256, n=64, bits=4, group_size=64, symmetric=True, dtype="fp32")
    x = args["x"].copy()
    x[3, 10], x[20, 0], x[40, 255] = np.nan, np.inf, -np.inf
    got = quantized_gemm.gemm(x, args["qweight"], activations="int8")
    assert np.isnan(got[[3, 20, 40]]).all()
    clean = [r for r in range(48) if r not in (3, 20, 40)]
    again = quantized_gemm.gemm(np.ascontiguousarray(x[clean]), args["qweight"], activations="int8")
    np.testing.assert_array_equal(got[clean].view(np.uint32), again.view(np.uint32))


@pytest.mark.parametrize(("m", "k", "n", "group"), [(32, 256, 64, 64), (33, 512, 200, 128), (47, 768, 96, 256),
                                                   (100, 1024, 130, 512), (64, 1024, 1000, 1024)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_w8a8_tiles_give_the_vector_kernels_bits(amx: _native.Native, m: int, k: int, n: int, group: int,
                                                 symmetric: bool, threads: int) -> None:
    """W8A8 from 32 rows: segments of 64..512 rows, groups split into segments, partial panels and row tiles: bit
    for bit the vector kernel, and within the op's tolerance of the float64 reference."""
    seed = 7000 + m * 100 + group + symmetric
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    args = quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=8, group_size=group, symmetric=symmetric, dtype="fp32")
    tiles, vector = _both(amx, args["x"], args["qweight"], threads)
    np.testing.assert_array_equal(tiles.view(np.uint32), vector.view(np.uint32))
    expected = REFERENCE(args)
    np.testing.assert_allclose(tiles, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_w8a8_act_order_stays_on_the_vector_kernel(amx: _native.Native) -> None:
    """Act-order int8 weights (a permutation of K) keep the vector kernel: the same result with AMX on or off."""
    rng = np.random.default_rng(11)
    print("seed=11")
    args = quantized_gemm_inputs(rng, m=40, k=256, n=64, bits=8, group_size=64, symmetric=True, dtype="fp32",
                                 act_order=True)
    tiles, vector = _both(amx, args["x"], args["qweight"], None)
    np.testing.assert_array_equal(tiles.view(np.uint32), vector.view(np.uint32))
