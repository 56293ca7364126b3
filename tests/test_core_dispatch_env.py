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


FAILING = '''
from hal_core import API_VERSION, KernelCompileError, hookimpl
from halfakes import HostBackend, touch


def gemm(call):
    touch("{marker}")
    raise KernelCompileError("hal_w4a16_gemm", "error: expected a ';'", ("-arch=sm_90",))


def broken_supports(call):
    raise RuntimeError("supports is broken")


class FailingBackend(HostBackend):
    name = "failing"
    priority = 5

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, priority=10, name="failing-gemm")
        registry.register("quantized_gemm", gemm, priority=20, supports=broken_supports, name="broken-supports")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [FailingBackend]
'''


def test_compile_failure_and_raising_supports_fall_back_correctly(make_plugin, caplog) -> None:
    """A KernelCompileError or a raising supports() runs the call on the CPU path, with both reasons logged."""
    plugin = make_plugin("failing", FAILING)
    x, qw, ref = _args(8)
    out = np.full((8, 32), 7.0, np.float32)
    with caplog.at_level(logging.WARNING, logger="hal"):
        result = hal_core.get_backend("failing").ops.quantized_gemm(x, qw, out=out)
    assert result is out
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert plugin.ran() == 1
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "failed to compile" in message and "supports() raised RuntimeError" in message


def test_compile_failure_under_strict_raises_fallback_error(make_plugin, monkeypatch) -> None:
    """HAL_STRICT=1: a kernel that fails to compile is a FallbackError naming the kernel, out untouched."""
    make_plugin("failing", FAILING)
    monkeypatch.setenv("HAL_STRICT", "1")
    x, qw, _ = _args(8)
    out = np.full((8, 32), 7.0, np.float32)
    with pytest.raises(FallbackError, match="hal_w4a16_gemm"):
        hal_core.get_backend("failing").ops.quantized_gemm(x, qw, out=out)
    assert (out == 7.0).all()


def test_non_array_argument_is_a_type_error_naming_it(cpu) -> None:
    """A list where an array is expected is an ArgumentTypeError naming the argument."""
    x, qw, _ = _args(4)
    with pytest.raises(hal_core.ArgumentTypeError, match="'x'"):
        cpu.ops.quantized_gemm(x.tolist(), qw)
