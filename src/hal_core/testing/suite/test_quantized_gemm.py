"""quantized_gemm (W4A16 and W8A8) against the float64 reference, plus edge cases and errors."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.quant import quantize
from hal_core.testing.inputs import assert_close, quantized_gemm_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES, OP_SETTINGS, seeds

REFERENCE = OPS["quantized_gemm"].reference


def _run(backend: Any, args: dict[str, Any], out: Any = None) -> np.ndarray:
    dev = to_backend(backend, "quantized_gemm", args)
    return backend.to_numpy(backend.ops.quantized_gemm(dev["x"], dev["qweight"], out=out))


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from((4, 8)),
    group_size=st.sampled_from((32, 64, 128)),
    groups=st.integers(1, 4),
    symmetric=st.booleans(),
    act_order=st.booleans(),
    m=st.integers(1, 40),
    n=st.integers(1, 70),
)
def test_quantized_gemm_matches_reference(hal_backend: Any, seed: int, dtype: str, bits: int, group_size: int,
                                          groups: int, symmetric: bool, act_order: bool, m: int, n: int) -> None:
    """int4 and int8 weights, G = 32/64/128, symmetric or with zeros, act-order or not, match float64."""
    rng = np.random.default_rng(seed)
    args = quantized_gemm_inputs(rng, m=m, k=groups * group_size, n=n, bits=bits, group_size=group_size,
                                 symmetric=symmetric, dtype=dtype, act_order=act_order)
    got = _run(hal_backend, args)
    assert got.dtype == args["x"].dtype
    assert_close(got, REFERENCE(args), kind="gemm", dtype=dtype, what=f"quantized_gemm int{bits}")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gemm_no_rows(hal_backend: Any, hal_rng: np.random.Generator, bits: int) -> None:
    """M = 0 returns an empty [0, N] array of x's dtype."""
    args = quantized_gemm_inputs(hal_rng, m=0, k=64, n=16, bits=bits, group_size=32, symmetric=True, dtype="fp16")
    got = _run(hal_backend, args)
    assert got.shape == (0, 16) and got.dtype == np.float16


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gemm_writes_out(hal_backend: Any, hal_rng: np.random.Generator, bits: int) -> None:
    """With out=, the result lands in out and out is returned."""
    args = quantized_gemm_inputs(hal_rng, m=5, k=128, n=24, bits=bits, group_size=64, symmetric=False, dtype="fp32")
    dev = to_backend(hal_backend, "quantized_gemm", args)
    out = hal_backend.asarray(np.zeros((5, 24), np.float32))
    result = hal_backend.ops.quantized_gemm(dev["x"], dev["qweight"], out=out)
    assert result is out
    assert_close(hal_backend.to_numpy(out), REFERENCE(args), kind="gemm", dtype="fp32")


def test_quantize_rejects_k_not_divisible_by_group() -> None:
    """quantize refuses K not divisible by G, naming group_size."""
    with pytest.raises(ValueError, match="'group_size'"):
        quantize(np.ones((96, 8)), bits=4, group_size=64)


BAD_INPUTS = [
    ("x-rank", ArgumentError, "x"),
    ("x-dtype", ArgumentTypeError, "x"),
    ("x-k-mismatch", ArgumentError, "x"),
    ("x-non-contiguous", ArgumentError, "x"),
    ("qweight-type", ArgumentTypeError, "qweight"),
    ("scales-dtype", ArgumentTypeError, "qweight.scales"),
    ("qweight-dtype", ArgumentTypeError, "qweight.qweight"),
    ("g-idx-negative", ArgumentError, "qweight.g_idx"),
    ("g-idx-too-large", ArgumentError, "qweight.g_idx"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_quantized_gemm_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                  error: type[Exception], argument: str) -> None:
    """Bad input raises the right error naming the argument and leaves out untouched."""
    args = quantized_gemm_inputs(hal_rng, m=4, k=64, n=8, bits=4, group_size=32, symmetric=True, dtype="fp32",
                                 act_order=case.startswith("g-idx"))
    qw = args["qweight"]
    if case == "x-rank":
        args["x"] = args["x"][0]
    elif case == "x-dtype":
        args["x"] = args["x"].astype(np.int32)
    elif case == "x-k-mismatch":
        args["x"] = args["x"][:, :32].copy()
    elif case == "scales-dtype":
        args["qweight"] = replace(qw, scales=np.ones(qw.scales.shape, np.int32))
    elif case == "qweight-dtype":
        args["qweight"] = replace(qw, qweight=qw.qweight.astype(np.int32))
    elif case in ("g-idx-negative", "g-idx-too-large"):
        g_idx = qw.g_idx.copy()
        g_idx[5] = -1 if case == "g-idx-negative" else 64 // 32  # K // G: one past the last group
        args["qweight"] = replace(qw, g_idx=g_idx)
    sentinel = np.full((4, 8), 7.0, np.float32)
    out = hal_backend.asarray(sentinel)
    dev = to_backend(hal_backend, "quantized_gemm", args) if case != "qweight-type" else None
    x = dev["x"] if dev else hal_backend.asarray(args["x"])
    if case == "x-non-contiguous":  # strided in the backend's domain, where asarray cannot fix it
        x = hal_backend.asarray(np.concatenate([args["x"], args["x"]], axis=1))[:, ::2]
    qweight = dev["qweight"] if dev else args["qweight"].dequantize(np.float32)
    with pytest.raises(error) as info:
        hal_backend.ops.quantized_gemm(x, qweight, out=out)
    message = str(info.value)
    names = repr(argument) in message or (case.startswith("g-idx") and "g_idx" in message)
    assert names, f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(out), sentinel, err_msg="out was modified")
