"""The ops front door under HAL_FORCE_CPU and HAL_STRICT, and fallback logging."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import hal_core
from hal_core import FallbackError
from hal_core.ops import OPS
from hal_core.quant import quantize

RECORDING = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend, touch


def gemm(call):
    touch("{marker}")
    return call.spec.reference(call.args).astype(call.spec.output_dtype(call.args))


def supports(call):
    return True if call["x"].shape[0] >= 4 else "M below 4 rows does not pay"


class DeviceLikeBackend(HostBackend):
    name = "devicelike"
    priority = 5
    instances = 0

    def __init__(self):
        type(self).instances += 1

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, priority=10, supports=supports, name="recording-gemm")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [DeviceLikeBackend]
'''


def _args(m: int, seed: int = 0) -> tuple[np.ndarray, hal_core.quant.QuantizedWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, 64)).astype(np.float32)
    qw = quantize(rng.standard_normal((64, 32)) / 8, group_size=32)
    ref = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    return x, qw, ref


def test_device_impl_runs_normally(make_plugin) -> None:
    """Without HAL_* switches, the backend's own implementation runs."""
    plugin = make_plugin("devicelike", RECORDING)
    x, qw, ref = _args(8)
    out = hal_core.get_backend("devicelike").ops.quantized_gemm(x, qw)
    assert plugin.ran() == 1
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_force_cpu_skips_the_device_impl_but_keeps_the_backend(make_plugin, monkeypatch) -> None:
    """HAL_FORCE_CPU=1: the device impl is never called, results equal the reference, the backend stays bound."""
    plugin = make_plugin("devicelike", RECORDING)
    monkeypatch.setenv("HAL_FORCE_CPU", "1")
    backend = hal_core.get_backend("devicelike")
    x, qw, ref = _args(8)
    out = backend.ops.quantized_gemm(x, qw)
    assert plugin.ran() == 0
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert hal_core.get_backend("devicelike") is backend
    assert type(backend).instances == 1
    assert next(b for b in hal_core.list_backends() if b.name == "devicelike").loaded


def test_strict_turns_a_fallback_into_an_error(make_plugin, monkeypatch) -> None:
    """HAL_STRICT=1: a call no implementation supports raises FallbackError with the reason."""
    plugin = make_plugin("devicelike", RECORDING)
    monkeypatch.setenv("HAL_STRICT", "1")
    x, qw, _ = _args(2)
    with pytest.raises(FallbackError, match="M below 4 rows"):
        hal_core.get_backend("devicelike").ops.quantized_gemm(x, qw)
    assert plugin.ran() == 0


def test_fallback_is_correct_and_logged_once_per_op_and_reason(make_plugin, caplog) -> None:
    """An unsupported call falls back with a correct result; the warning is logged once per (op, reason)."""
    plugin = make_plugin("devicelike", RECORDING)
    backend = hal_core.get_backend("devicelike")
    x, qw, ref = _args(2)
    with caplog.at_level(logging.WARNING, logger="hal"):
        for _ in range(3):
            out = backend.ops.quantized_gemm(x, qw)
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert plugin.ran() == 0
    fallbacks = [r for r in caplog.records if "M below 4 rows" in r.getMessage()]
    assert len(fallbacks) == 1
    assert "quantized_gemm" in fallbacks[0].getMessage()


def test_force_cpu_does_not_touch_the_cpu_backend_itself(cpu, monkeypatch) -> None:
    """HAL_FORCE_CPU=1 on the CPU backend runs its own implementations as usual."""
    monkeypatch.setenv("HAL_FORCE_CPU", "1")
    x, qw, ref = _args(8)
    np.testing.assert_allclose(cpu.ops.quantized_gemm(x, qw), ref, rtol=1e-4, atol=1e-4)
