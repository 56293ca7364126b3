"""rms_norm against the float64 reference: plain and fused-add forms, strided rows, in place, NaN rows, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, rms_norm_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES, OP_SETTINGS, seeds

REFERENCE = OPS["rms_norm"].reference


def _run(backend: Any, args: dict[str, Any], **extra: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """The call on ``backend``: (out, residual after the call or None), on the host."""
    dev = to_backend(backend, "rms_norm", args)
    options = {name: dev[name] for name in ("residual", "weight_offset") if dev.get(name) is not None}
    out = backend.ops.rms_norm(dev["x"], dev["weight"], epsilon=dev["epsilon"], **options, **extra)
    residual = backend.to_numpy(dev["residual"]) if dev.get("residual") is not None else None
    return backend.to_numpy(out), residual


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    num_tokens=st.integers(1, 9),
    hidden_size=st.sampled_from((1, 3, 16, 63, 100, 513, 1024, 2049)),
    residual=st.booleans(),
    gap=st.sampled_from((0, 5)),
    weight_offset=st.sampled_from((None, 0.0, 1.0)),
)
def test_rms_norm_matches_reference(hal_backend: Any, seed: int, dtype: str, num_tokens: int, hidden_size: int,
                                    residual: bool, gap: int, weight_offset: float | None) -> None:
    """Every row is normalised and weighted; with a residual the rounded sum is written back bit-exactly."""
    rng = np.random.default_rng(seed)
    args = rms_norm_inputs(rng, num_tokens=num_tokens, hidden_size=hidden_size, dtype=dtype, residual=residual,
                           row_stride=hidden_size + gap)
    if weight_offset is not None:
        args["weight_offset"] = weight_offset
    expected, expected_residual = REFERENCE(args)
    got, got_residual = _run(hal_backend, args)
    assert_close(got, expected, kind="elementwise", dtype=dtype, what="out")
    if residual:
        assert expected_residual is not None
        assert_close(got_residual, expected_residual, kind="copy", dtype=dtype, what="residual")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_out_is_x(hal_backend: Any, hal_rng: np.random.Generator, dtype: str) -> None:
    """``out=x`` normalises x in place (with and without a residual)."""
    for residual in (False, True):
        args = rms_norm_inputs(hal_rng, num_tokens=5, hidden_size=130, dtype=dtype, residual=residual)
        args["x"] = np.ascontiguousarray(args["x"])
        expected, _ = REFERENCE(args)
        dev = to_backend(hal_backend, "rms_norm", args)
        options = {"residual": dev["residual"]} if residual else {}
        result = hal_backend.ops.rms_norm(dev["x"], dev["weight"], epsilon=args["epsilon"], out=dev["x"], **options)
        assert result is dev["x"]
        assert_close(hal_backend.to_numpy(dev["x"]), expected, kind="elementwise", dtype=dtype, what="x")


def test_rms_norm_nan_row(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """A NaN in one row (of x or of residual) makes that row NaN and leaves the others right."""
    args = rms_norm_inputs(hal_rng, num_tokens=4, hidden_size=67, dtype="fp32")
    args["x"][1, 60] = np.nan
    args["residual"][3, 2] = np.nan
    expected, expected_residual = REFERENCE(args)
    assert np.isnan(expected[[1, 3]]).all() and np.isfinite(expected[[0, 2]]).all()
    got, got_residual = _run(hal_backend, args)
    assert_close(got, expected, kind="elementwise", dtype="fp32", what="out")
    assert expected_residual is not None
    assert_close(got_residual, expected_residual, kind="copy", dtype="fp32", what="residual")


def test_rms_norm_no_tokens(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """num_tokens = 0: an empty result, the residual untouched."""
    args = rms_norm_inputs(hal_rng, num_tokens=0, hidden_size=64, dtype="bf16")
    got, _ = _run(hal_backend, args)
    assert got.shape == (0, 64)


BAD_INPUTS = [
    ("x-rank", ArgumentError, "x"),
    ("weight-shape", ArgumentError, "weight"),
    ("weight-dtype", ArgumentTypeError, "weight"),
    ("residual-shape", ArgumentError, "residual"),
    ("residual-dtype", ArgumentTypeError, "residual"),
    ("epsilon-negative", ArgumentError, "epsilon"),
    ("epsilon-nan", ArgumentTypeError, "epsilon"),
    ("weight-offset-inf", ArgumentTypeError, "weight_offset"),
    ("residual-is-x", ArgumentError, "residual"),
    ("residual-is-out", ArgumentError, "residual"),
    ("out-shape", ArgumentError, "out"),
    ("x-columns-strided", ArgumentError, "x"),
    ("weight-strided", ArgumentError, "weight"),
    ("residual-overlaps-x", ArgumentError, "residual"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_rms_norm_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str, error: type[Exception],
                            argument: str) -> None:
    """Bad input raises the right error naming the argument, and neither residual nor out is written."""
    args = rms_norm_inputs(hal_rng, num_tokens=4, hidden_size=32, dtype="fp32")
    out = np.zeros((4, 32), np.float32)
    if case == "x-rank":
        args["x"] = args["x"][0]
    elif case == "weight-shape":
        args["weight"] = args["weight"][:31].copy()
    elif case == "weight-dtype":
        args["weight"] = args["weight"].astype(np.float16)
    elif case == "residual-shape":
        args["residual"] = args["residual"][:3].copy()
    elif case == "residual-dtype":
        args["residual"] = args["residual"].astype(np.float16)
    elif case == "epsilon-negative":
        args["epsilon"] = -1e-6
    elif case == "epsilon-nan":
        args["epsilon"] = float("nan")
    elif case == "weight-offset-inf":
        args["weight_offset"] = float("inf")
    elif case == "out-shape":
        out = np.zeros((4, 31), np.float32)
    elif case == "x-columns-strided":
        args["x"] = np.repeat(args["x"], 2, axis=1)[:, ::2]
    elif case == "weight-strided":
        args["weight"] = np.repeat(args["weight"], 2)[::2]
    dev = to_backend(hal_backend, "rms_norm", args)
    dev_out = hal_backend.asarray(out)
    if case == "residual-is-x":
        dev["residual"] = dev["x"]
    elif case == "residual-overlaps-x":  # x is rows 0-3 of a [5, 32] array, the residual rows 1-4
        both = hal_backend.asarray(np.concatenate([args["x"], args["residual"][:1]]))
        dev["x"], dev["residual"] = both[:4], both[1:]
    elif case == "residual-is-out":
        dev_out = dev["residual"]
    before = hal_backend.to_numpy(dev["residual"]).copy()
    with pytest.raises(error) as info:
        hal_backend.ops.rms_norm(dev["x"], dev["weight"], epsilon=dev["epsilon"], residual=dev["residual"],
                                 weight_offset=dev.get("weight_offset"), out=dev_out)
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(dev["residual"]), before)
    if case != "residual-is-out":
        np.testing.assert_array_equal(hal_backend.to_numpy(dev_out), out)
