"""OpImpl.plan: a bound op's repeated signature runs the implementation's runner, with the front door's results,
counts, fallbacks and errors; a runner that raises, returns the wrong result or whose plan fails never costs
the caller a correct answer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import FrozenInstanceError, replace
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core.ops import OpCall, OpImpl
from hal_core.quant import quantize


def _weight(rng: np.random.Generator, k: int = 64, n: int = 24) -> Any:
    return quantize(rng.standard_normal((k, n)).astype(np.float32), bits=4, group_size=32)


def _reference(x: np.ndarray, w: Any) -> np.ndarray:
    return (x.astype(np.float64) @ w.dequantize(np.float64)).astype(np.float32)


class _Planned:
    """An implementation of quantized_gemm with a plan: ``fn`` and the runner compute the float64 product,
    each counting its calls; ``runner_fault`` makes the runner raise or return a wrong shape."""

    def __init__(self) -> None:
        self.fn_calls = 0
        self.plans: list[frozenset[str]] = []
        self.runner_calls = 0
        self.runner_fault: str | None = None
        self.plan_fault = False

    def fn(self, call: OpCall) -> np.ndarray:
        self.fn_calls += 1
        return _reference(call["x"], call["qweight"])

    def plan(self, call: OpCall) -> Any:
        self.plans.append(call.fixed)
        if self.plan_fault:
            raise RuntimeError("plan failed")
        weight = call["qweight"]

        def run(args: Mapping[str, Any]) -> np.ndarray:
            self.runner_calls += 1
            if self.runner_fault == "raise":
                raise RuntimeError("runner failed")
            if self.runner_fault == "shape":
                return np.zeros((1, 1), np.float32)
            assert args["qweight"] is weight  # a bound argument is the same object in every call
            return _reference(args["x"], weight)

        return run

    def register(self, backend: hal_core.Backend) -> None:
        backend.ops.registry.register(OpImpl(op="quantized_gemm", fn=self.fn, name="planned", priority=10**9,
                                             plan=self.plan))


def _planned_call(backend: hal_core.Backend, rng: np.random.Generator) -> tuple[_Planned, Any, Any, np.ndarray]:
    """A registered :class:`_Planned`, a weight bound, and rows whose signature its first call planned."""
    impl = _Planned()
    impl.register(backend)
    w = _weight(rng)
    bound = backend.ops.bind("quantized_gemm", qweight=w)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    bound(x=x)
    return impl, w, bound, x


def test_a_signature_plans_once_and_its_runner_serves_the_next_calls(cpu: hal_core.Backend,
                                                                     hal_rng: np.random.Generator,
                                                                     hal_seed: int) -> None:
    """The first call of a signature runs ``fn`` and asks for a plan (told which arguments are bound); the next
    ones run the runner, with fresh values each time, counted as the implementation's calls."""
    print(f"seed={hal_seed}")
    impl = _Planned()
    impl.register(cpu)
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    before = cpu.ops.stats().get("quantized_gemm", {}).get("implementations", {}).get("planned", 0)
    for _ in range(4):
        x = hal_rng.standard_normal((3, 64)).astype(np.float32)
        np.testing.assert_array_equal(bound(x=x), _reference(x, w))
    assert impl.fn_calls == 1 and impl.runner_calls == 3
    assert impl.plans == [frozenset({"qweight"})]
    assert cpu.ops.stats()["quantized_gemm"]["implementations"]["planned"] == before + 4
    x = hal_rng.standard_normal((5, 64)).astype(np.float32)  # a new signature: fn, and a plan of its own
    np.testing.assert_array_equal(bound(x=x), _reference(x, w))
    assert impl.fn_calls == 2 and len(impl.plans) == 2


def test_the_front_door_runs_no_plan_for_a_weight_given_per_call(cpu: hal_core.Backend,
                                                                  hal_rng: np.random.Generator) -> None:
    """A weight is a value no signature holds: the front door checks it in full and runs ``fn`` every call."""
    impl = _Planned()
    impl.register(cpu)
    w = _weight(hal_rng)
    for _ in range(3):
        x = hal_rng.standard_normal((2, 64)).astype(np.float32)
        np.testing.assert_array_equal(cpu.ops.quantized_gemm(x=x, qweight=w), _reference(x, w))
    assert impl.fn_calls == 3 and impl.plans == [] and impl.runner_calls == 0


@pytest.mark.parametrize("fault", ["raise", "shape"])
def test_a_faulty_runner_falls_back_with_the_right_result(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                          monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """A runner that raises or returns a result of the wrong shape is the implementation's fault: the call falls
    back (watched, counted) and gives the right product; under HAL_STRICT=1 it is an ImplementationError."""
    impl, w, bound, x = _planned_call(cpu, hal_rng)
    impl.runner_fault = fault
    with cpu.ops.watch() as events:
        got = bound(x=x)
    assert impl.runner_calls == 1 and [e.kind for e in events] == ["fault", "fallback"]
    np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal_core.ImplementationError, match="planned"):
        bound(x=x)


def test_a_failing_plan_leaves_fn_serving_and_is_an_error_when_strict(cpu: hal_core.Backend,
                                                                      hal_rng: np.random.Generator,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    impl = _Planned()
    impl.plan_fault = True
    impl.register(cpu)
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    for _ in range(3):
        x = hal_rng.standard_normal((2, 64)).astype(np.float32)
        np.testing.assert_array_equal(bound(x=x), _reference(x, w))
    assert impl.fn_calls == 3 and impl.runner_calls == 0 and len(impl.plans) == 1
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal_core.ImplementationError, match="plan\\(\\) raised RuntimeError: plan failed"):
        cpu.ops.bind("quantized_gemm", qweight=w)(x=x)


def test_a_registry_change_drops_the_runners(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    """A registration after a signature was planned: the next call asks the registry again (here a new
    implementation wins), and the planned runner is not run."""
    impl, _, bound, x = _planned_call(cpu, hal_rng)
    bound(x=x)
    assert impl.runner_calls == 1
    cpu.ops.registry.register(OpImpl(op="quantized_gemm", fn=lambda call: np.full((2, 24), 7, np.float32),
                                     name="sevens", priority=10**9 + 1))
    np.testing.assert_array_equal(bound(x=x), np.full((2, 24), 7, np.float32))
    assert impl.runner_calls == 1



def test_signature_only_drops_the_calls_own_arrays(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    """What a plan may keep of its first call: the bound arguments and the plain values, not the call's own
    arrays (the activations); the options object bound with the op stays."""
    seen: list[OpCall] = []
    impl = _Planned()
    plan = impl.plan
    impl.plan = lambda call: (seen.append(call), plan(call))[1]  # type: ignore[method-assign]
    impl.register(cpu)
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    bound(x=hal_rng.standard_normal((2, 64)).astype(np.float32))
    (call,) = seen
    kept = call.signature_only()
    assert "x" in call.args and "x" not in kept.args
    assert kept.args["qweight"] is w and kept.fixed == call.fixed and kept.spec is call.spec
    assert all(call.args[name] == value for name, value in kept.args.items() if name != "qweight")
    assert kept.given_options is call.given_options


def test_with_args_is_the_kept_call_with_new_arguments(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    """``kept.with_args(args)``, what a runner makes per call, equals ``replace(kept, args=args, fixed=frozenset())``
    field by field and carries none of the kept call's cached values."""
    seen: list[OpCall] = []
    impl = _Planned()
    plan = impl.plan
    impl.plan = lambda call: (seen.append(call), plan(call))[1]  # type: ignore[method-assign]
    impl.register(cpu)
    bound = cpu.ops.bind("quantized_gemm", qweight=_weight(hal_rng))
    bound(x=hal_rng.standard_normal((2, 64)).astype(np.float32))
    kept = seen[0].signature_only()
    first = kept.with_args({**kept.args, "x": hal_rng.standard_normal((2, 64)).astype(np.float32)})
    _ = first.nbytes, first.flops  # cached on that call
    args = {**kept.args, "x": hal_rng.standard_normal((3, 64)).astype(np.float32)}
    each = first.with_args(args)
    assert each == replace(first, args=args, fixed=frozenset())
    assert each.args is args and each.fixed == frozenset() and type(each) is OpCall
    assert "nbytes" not in each.__dict__ and "flops" not in each.__dict__
    assert each.nbytes == kept.spec.nbytes(args) != first.nbytes
    with pytest.raises(FrozenInstanceError):
        each.args = {}  # type: ignore[misc]


PLANNED_PLUGIN = '''
from hal_core import API_VERSION, hookimpl
from hal_core.ops import OpCall
from halfakes import HostBackend, touch


def gemm(call):
    return call.spec.reference(call.args).astype(call.spec.output_dtype(call.args))


def plan(call):
    def run(args):
        touch("{marker}")
        return gemm(OpCall(spec=call.spec, args=args, backend=call.backend))
    return run


class PlannedBackend(HostBackend):
    name = "plannedlike"
    priority = 5

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, priority=10, name="planned-gemm", plan=plan)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [PlannedBackend]
'''


def test_force_cpu_is_read_on_every_planned_call(make_plugin: Any, hal_rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A device-like backend's planned signature: its runner serves the repeated call until HAL_FORCE_CPU=1 is
    set, then the CPU path does (the runner is never run), with the right product."""
    plugin = make_plugin("plannedlike", PLANNED_PLUGIN)
    backend = hal_core.get_backend("plannedlike")
    w = _weight(hal_rng)
    bound = backend.ops.bind("quantized_gemm", qweight=w)
    x = hal_rng.standard_normal((2, 64)).astype(np.float32)
    bound(x=x)
    bound(x=x)
    assert plugin.ran() == 1
    monkeypatch.setenv("HAL_FORCE_CPU", "1")
    np.testing.assert_allclose(bound(x=x), _reference(x, w), rtol=1e-4, atol=1e-4)
    assert plugin.ran() == 1


def test_register_refuses_a_plan_that_is_not_callable(cpu: hal_core.Backend) -> None:
    with pytest.raises(TypeError, match="plan must be callable"):
        cpu.ops.registry.register("quantized_gemm", lambda call: None, name="bad", plan=42)  # type: ignore[arg-type]


class _PlannedNorm:
    """An implementation of rms_norm with a plan: ``fn`` and the runner compute the float64 reference, counting
    their calls."""

    def __init__(self) -> None:
        self.fn_calls = self.runner_calls = 0
        self.plans: list[frozenset[str]] = []

    @staticmethod
    def _result(args: Mapping[str, Any]) -> np.ndarray:
        out, _ = hal_core.ops.OPS["rms_norm"].reference(args)
        return out.astype(args["x"].dtype)

    def fn(self, call: OpCall) -> np.ndarray:
        self.fn_calls += 1
        return self._result(call.args)

    def plan(self, call: OpCall) -> Any:
        self.plans.append(call.fixed)

        def run(args: Mapping[str, Any]) -> np.ndarray:
            self.runner_calls += 1
            return self._result(args)

        return run

    def register(self, backend: hal_core.Backend) -> None:
        backend.ops.registry.register(OpImpl(op="rms_norm", fn=self.fn, name="planned-norm", priority=10**9,
                                             plan=self.plan))


def test_the_front_door_runs_a_plan_for_host_arrays(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                    hal_seed: int) -> None:
    """Numpy arrays and plain values at the front door take the bound path: the first call of a signature is
    checked in full and plans, the next ones run the runner with fresh values; a new shape plans again; the
    value checks still run on a kept signature (a residual overlapping ``x``); a value that is not an array gets
    the full path's error."""
    print(f"seed={hal_seed}")
    impl = _PlannedNorm()
    impl.register(cpu)
    weight = hal_rng.standard_normal(32).astype(np.float32)
    for _ in range(3):
        x = hal_rng.standard_normal((2, 32)).astype(np.float32)
        expected = hal_core.ops.OPS["rms_norm"].reference({"x": x, "weight": weight, "epsilon": 1e-5})[0]
        np.testing.assert_allclose(cpu.ops.rms_norm(x, weight, epsilon=1e-5), expected, rtol=1e-6)
    assert (impl.fn_calls, impl.runner_calls, impl.plans) == (1, 2, [frozenset()])
    cpu.ops.rms_norm(hal_rng.standard_normal((3, 32)).astype(np.float32), weight, epsilon=1e-5)
    assert (impl.fn_calls, len(impl.plans)) == (2, 2)
    both = hal_rng.standard_normal((2, 64)).astype(np.float32)
    cpu.ops.rms_norm(both[:, :32], weight, residual=both[:, 32:], epsilon=1e-5)  # plans this signature
    with pytest.raises(hal_core.ArgumentError, match="'residual'"):
        cpu.ops.rms_norm(both[:, :32], weight, residual=both[:, 1:33], epsilon=1e-5)
    with pytest.raises(hal_core.ArgumentTypeError, match="'x'"):  # not an array: the full path's error
        cpu.ops.call("rms_norm", {"x": x.tolist(), "weight": weight, "epsilon": 1e-5})
    calls = impl.runner_calls
    np.testing.assert_allclose(cpu.ops.call("rms_norm", {"x": x, "weight": weight, "epsilon": 1e-5}),
                               cpu.ops.rms_norm(x, weight, epsilon=1e-5))
    assert impl.runner_calls == calls + 2


def test_a_knob_override_block_neither_uses_nor_keeps_a_signature(cpu: hal_core.Backend,
                                                                   hal_rng: np.random.Generator) -> None:
    """Inside ``hal_core.tuning.override`` (the tuner's forced knobs) a bound op runs ``fn`` on a signature it
    planned before, and keeps nothing it learns there; after the block its runner serves again."""
    impl, w, bound, x = _planned_call(cpu, hal_rng)
    with hal_core.tuning.override({"kernel": "tiles"}):
        np.testing.assert_array_equal(bound(x=x), _reference(x, w))
        other = hal_rng.standard_normal((3, 64)).astype(np.float32)
        np.testing.assert_array_equal(bound(x=other), _reference(other, w))
    assert (impl.fn_calls, impl.runner_calls, len(impl.plans)) == (3, 0, 1)
    bound(x=x)
    bound(x=other)  # planned now, outside the block
    assert (impl.fn_calls, impl.runner_calls, len(impl.plans)) == (4, 1, 2)
