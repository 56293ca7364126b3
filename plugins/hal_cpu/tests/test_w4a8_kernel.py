"""The compiled W4A8 kernel (int4 weights, per-token int8 activations) against float64 references, on every ISA."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import _w4a8, quantized_gemm

import hal_core
from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize, quantize_activations
from hal_core.testing.inputs import quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference
M_VALUES = [1, 2, 3, 7, 8, 16, 33, 64]
EPS32 = 2.0**-24


def _run(x: np.ndarray, qweight: QuantizedWeight, threads: int | None = None) -> np.ndarray:
    return quantized_gemm.gemm(x, qweight, activations="int8", threads=threads)


def _float_bound(x: np.ndarray, qweight: QuantizedWeight) -> np.ndarray:
    """The float32 rounding the kernel may add to the exact W4A8 value: (2 groups + 2) * 2**-24 * sx * (|xq| @ |w|).

    Each group adds at most two roundings (its exact integer sum converted to float, one fma), the token scale one.
    """
    xq, sx = quantize_activations(x)
    magnitude = np.abs(xq.astype(np.float64)) @ np.abs(qweight.dequantize(np.float64))
    groups = qweight.shape[0] // qweight.group_size
    return (2 * groups + 2) * EPS32 * sx.astype(np.float64)[:, None] * magnitude + 1e-30


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a8_matches_the_exact_reference(variant: str, rng: np.random.Generator, m: int, group_size: int,
                                          symmetric: bool) -> None:
    """Every variant, M and group size: within float32 rounding of the float64 W4A8 reference (N = 83: a ragged
    column tail after a full 64-column block)."""
    args = quantized_gemm_inputs(rng, m=m, k=256, n=83, bits=4, group_size=group_size, symmetric=symmetric,
                                 dtype="fp32")
    got = _run(args["x"], args["qweight"])
    expected = REFERENCE({**args, "activations": "int8"})
    error = np.abs(got - expected)
    assert (error <= _float_bound(args["x"], args["qweight"])).all(), f"{variant}: max error {error.max():.3g}"


@pytest.mark.parametrize("m", [1, 2, 4, 5, 33])
@pytest.mark.parametrize("n", [5, 16, 96, 112, 164])
@pytest.mark.parametrize("symmetric", [True, False])
def test_integer_sums_are_exact(variant: str, rng: np.random.Generator, m: int, n: int, symmetric: bool) -> None:
    """Integer activations with max |x| = 127 (sx = 1, xq = x) and power-of-two scales: every float operation is
    exact, so the kernel must give sum_k x * (q - z) * s exactly (checks the nibble order and the zero points).
    N covers a column tail alone, 1 to 4 vectors of 16 after full 64-column blocks, and a tail after them."""
    k, group = 256, 64
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, 0] = 127.0
    codes = rng.integers(0, 16, size=(k, n), dtype=np.uint32)
    packed = np.zeros((k // 8, n), dtype=np.uint32)
    for t in range(8):
        packed |= codes[t::8] << np.uint32(4 * t)
    scales = (2.0 ** rng.integers(-6, 2, size=(k // group, n))).astype(np.float16)
    zeros = None if symmetric else rng.integers(0, 16, size=(k // group, n), dtype=np.uint8)
    qweight = QuantizedWeight(packed, scales, zeros, 4, group, (k, n))
    z = np.full((k // group, n), 8) if zeros is None else zeros.astype(np.int64)
    w = (codes.astype(np.int64) - np.repeat(z, group, axis=0)) * np.repeat(scales.astype(np.float64), group, axis=0)
    expected = x.astype(np.float64) @ w
    np.testing.assert_array_equal(_run(x, qweight), expected.astype(np.float32))
    assert np.array_equal(expected.astype(np.float32), expected)  # exact in float32: the test is exact


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 40])
@pytest.mark.parametrize("case", ["g32-zeros", "g40-zeros", "g128", "fp16-x", "bf16-x", "bf16-scales", "fp32-scales"])
def test_variants_and_threads_agree_bit_for_bit(select_isa: Callable[[str], AbstractContextManager[None]],
                                                rng: np.random.Generator, m: int, case: str) -> None:
    """vpdpbusd (avx512vnni), vpmaddubsw (avx2; g40: 5 code rows a group, a partial batch of int16 sums) and the
    plain integer loop of the other variants give the same bits, at any thread count (up to 8 rows on avx2 and
    avx512vnni: each thread's column range swept, 25 vectors of 8 or 12 of 16 cut unevenly, 8 columns left to the
    plain loop): integer sums are exact and the float epilogue is the same fma chain."""
    dtype = {"fp16-x": "fp16", "bf16-x": "bf16"}.get(case, "fp32")
    group = {"g32-zeros": 32, "g40-zeros": 40}.get(case, 128)
    args = quantized_gemm_inputs(rng, m=m, k=520 if group == 40 else 512, n=200, bits=4, group_size=group,
                                 symmetric=not case.endswith("zeros"), dtype=dtype)
    qw = args["qweight"]
    if case.endswith("scales"):
        wanted = BFLOAT16 if case == "bf16-scales" else np.float32
        args["qweight"] = qw = replace(qw, scales=np.asarray(qw.scales).astype(wanted))
    results = {}
    for name in _native.load().available:
        with select_isa(name):
            results[name] = _run(args["x"], qw)
            results[f"{name} threads=1"] = _run(args["x"], qw, threads=1)
            results[f"{name} threads=3"] = _run(args["x"], qw, threads=3)
    first = next(iter(results.values()))
    for name, got in results.items():
        np.testing.assert_array_equal(got, first, err_msg=name)
    error = np.abs(first - REFERENCE({**args, "activations": "int8"}))
    assert (error <= _float_bound(args["x"], qw)).all()


def _outliers(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` with 4 channels (columns) 50 to 100 times larger, as in real models' activations."""
    out = x.copy()
    channels = rng.choice(x.shape[1], size=4, replace=False)
    out[:, channels] *= rng.uniform(50.0, 100.0, size=4).astype(x.dtype)
    return out


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_w4a8_stays_within_its_bound_of_w4a16(variant: str, rng: np.random.Generator, outliers: bool,
                                              dtype: str) -> None:
    """|W4A8 - W4A16| <= sx / 2 * sum_k |w[k, n]| (+ float rounding): the per-token rounding of x is at most half a
    step; outlier channels make the step (amax / 127) 50-100x coarser for every channel of the row."""
    m, k, n = 16, 1024, 96
    rng_x = np.random.default_rng(int(rng.integers(1 << 31)))
    x = rng_x.standard_normal((m, k)).astype(np.float32)
    if outliers:
        x = _outliers(x, rng_x)
    x = x.astype(BFLOAT16 if dtype == "bf16" else np.dtype({"fp32": np.float32, "fp16": np.float16}[dtype]))
    qweight = quantize(rng.standard_normal((k, n)) / np.sqrt(k), bits=4, group_size=128, symmetric=True)
    w = qweight.dequantize(np.float64)
    w4a16 = x.astype(np.float64) @ w
    w4a8 = _run(x, qweight).astype(np.float64)
    _, sx = quantize_activations(x)
    bound = sx.astype(np.float64)[:, None] / 2 * np.abs(w).sum(axis=0)[None, :]
    bound += 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w))  # float32 sums of both results
    assert (np.abs(w4a8 - w4a16) <= bound).all()
    relative = np.linalg.norm(w4a8 - w4a16) / np.linalg.norm(w4a16)
    print(f"{variant} {dtype} outliers={outliers}: relative error vs W4A16 {relative:.2e}")
    assert relative < (0.15 if outliers else 0.02)


def test_non_finite_rows_are_nan_and_the_others_unchanged(variant: str, rng: np.random.Generator) -> None:
    """A row holding NaN, +inf or -inf gives a NaN row; the other rows equal a run without those rows."""
    args = quantized_gemm_inputs(rng, m=6, k=128, n=70, bits=4, group_size=32, symmetric=False, dtype="fp32")
    x = args["x"].copy()
    x[1, 5], x[3, 0], x[4, 127] = np.nan, np.inf, -np.inf
    got = _run(x, args["qweight"])
    assert np.isnan(got[[1, 3, 4]]).all()
    clean = [0, 2, 5]
    np.testing.assert_array_equal(got[clean], _run(np.ascontiguousarray(x[clean]), args["qweight"]))


@pytest.mark.parametrize("case", ["act-order", "group-12", "group-k"])
def test_weights_outside_the_integer_kernel_still_match(rng: np.random.Generator, case: str) -> None:
    """Act-order, a group size not a multiple of 8, and one group spanning K: still W4A8 within float tolerance."""
    k = {"group-12": 96, "group-k": 512}.get(case, 256)
    group = {"group-12": 12, "group-k": 512}.get(case, 32)
    args = quantized_gemm_inputs(rng, m=5, k=k, n=40, bits=4, group_size=group, symmetric=False, dtype="fp32",
                                 act_order=case == "act-order")
    assert _w4a8.integer_kernel(args["qweight"]) == (case == "group-k")
    got = _run(args["x"], args["qweight"])
    expected = REFERENCE({**args, "activations": "int8"})
    magnitude = quantize_activations(args["x"])[1][:, None] * (
        np.abs(quantize_activations(args["x"])[0].astype(np.float64)) @ np.abs(args["qweight"].dequantize()))
    assert (np.abs(got - expected) <= 1e-5 * magnitude + 1e-30).all()


def test_front_door_runs_the_integer_kernel_and_keeps_w4a16_the_default(rng: np.random.Generator) -> None:
    """The cpu backend's activations='int8' gives the kernel's bits; the default stays W4A16's."""
    args = quantized_gemm_inputs(rng, m=8, k=256, n=64, bits=4, group_size=64, symmetric=True, dtype="fp16")
    cpu = hal_core.get_backend("cpu")
    got = cpu.ops.quantized_gemm(args["x"], args["qweight"], activations="int8")
    np.testing.assert_array_equal(got, _run(args["x"], args["qweight"]).astype(np.float16))
    default = cpu.ops.quantized_gemm(args["x"], args["qweight"])
    np.testing.assert_array_equal(default, quantized_gemm.gemm(args["x"], args["qweight"]).astype(np.float16))


def test_numpy_fallback_computes_w4a8(rng: np.random.Generator) -> None:
    """Without the compiled library, int8 activations with int4 weights still give W4A8 (exact group sums)."""
    from hal_cpu.ops import _fallback_gemm

    args = quantized_gemm_inputs(rng, m=4, k=128, n=30, bits=4, group_size=32, symmetric=False, dtype="fp16")
    got = _fallback_gemm.gemm(args["x"], args["qweight"], int8_activations=True)
    error = np.abs(got - REFERENCE({**args, "activations": "int8"}))
    assert (error <= _float_bound(args["x"], args["qweight"])).all()
    assert not np.allclose(got, _fallback_gemm.gemm(args["x"], args["qweight"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rows_with_a_stride_are_read_in_place(rng: np.random.Generator, dtype: str) -> None:
    """x as a view of wider rows (row stride > K) gives the bits of its contiguous copy."""
    args = quantized_gemm_inputs(rng, m=9, k=128, n=48, bits=4, group_size=64, symmetric=False, dtype=dtype)
    wide = np.zeros((9, 200), dtype=args["x"].dtype)
    wide[:, 40:168] = args["x"]
    view = wide[:, 40:168]
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(_run(view, args["qweight"]), _run(np.ascontiguousarray(view), args["qweight"]))
