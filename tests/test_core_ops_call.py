"""``Ops.call(op, args)``: an op named at run time with its arguments as a mapping, as the op's method runs it."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest

from hal_core import ArgumentError

SEED = 20261205


def _inputs() -> dict[str, np.ndarray]:
    print(f"seed {SEED}")
    rng = np.random.default_rng(SEED)
    return {"x": rng.standard_normal((5, 24)).astype(np.float32),
            "weight": rng.standard_normal(24).astype(np.float32),
            "residual": rng.standard_normal((5, 24)).astype(np.float32)}


def _rms_norm64(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    h = (x.astype(np.float64) + residual.astype(np.float64)).astype(np.float32).astype(np.float64)
    return h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + eps) * weight.astype(np.float64), h


def test_call_runs_the_op_as_its_method_does(cpu) -> None:
    """rms_norm by name: out and the residual written as the float64 definition says, bit for bit the method's."""
    data = _inputs()
    expected, expected_residual = _rms_norm64(data["x"], data["residual"], data["weight"], 1e-6)
    by_method_residual = data["residual"].copy()
    by_method = cpu.ops.rms_norm(data["x"], data["weight"], epsilon=1e-6, residual=by_method_residual)
    out = np.empty_like(data["x"])
    result = cpu.ops.call("rms_norm", {**data, "epsilon": 1e-6, "out": out})
    assert result is out
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data["residual"], expected_residual, rtol=0, atol=0)
    np.testing.assert_array_equal(out, by_method)
    np.testing.assert_array_equal(data["residual"], by_method_residual)


def test_call_leaves_the_argument_mapping_unchanged(cpu) -> None:
    """The mapping keeps every key and value object (out included; the host number is not normalised in it)."""
    data = _inputs()
    out = np.empty_like(data["x"])
    eps = np.float32(1e-5)
    args = {"x": data["x"], "weight": data["weight"], "epsilon": eps, "out": out}
    before = dict(args)
    cpu.ops.call("rms_norm", args)
    assert args.keys() == before.keys()
    assert all(args[name] is before[name] for name in before)
    h = data["x"].astype(np.float64)
    expected = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-5) * data["weight"].astype(np.float64)
    np.testing.assert_allclose(cpu.ops.call("rms_norm", MappingProxyType(args)), expected, rtol=1e-5, atol=1e-5)


def test_call_of_an_unknown_op_is_an_argument_error_naming_it(cpu) -> None:
    """A name no op has: ArgumentError naming the 'op' argument and the name given."""
    with pytest.raises(ArgumentError, match=r"argument 'op': no op named 'rms_nrom'"):
        cpu.ops.call("rms_nrom", _inputs())


def test_call_with_an_undeclared_argument_is_refused_before_any_work(cpu) -> None:
    """A misspelt argument name is a TypeError naming it, and the in-place residual is left as it was."""
    data = _inputs()
    residual = data["residual"].copy()
    with pytest.raises(TypeError, match="epsilom"):
        cpu.ops.call("rms_norm", {**data, "epsilom": 1e-6})
    np.testing.assert_array_equal(data["residual"], residual)
