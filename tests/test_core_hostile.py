"""Hostile and broken plugins, installed as real throwaway distributions: none can hang, end or fool hal."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest

import hal_core
from hal_core.cli import collect_info
from hal_core.ops import OPS
from hal_core.quant import quantize

HANGING = '''
import time

from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend, touch


class HangingBackend(HostBackend):
    name = "hanging"
    priority = 50
    is_host = False

    @classmethod
    def availability(cls):
        touch("{marker}")
        time.sleep(120)  # a driver probe that never returns
        return super().availability()


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [HangingBackend]
'''


def _in_thread(fn, *args):
    """Run ``fn`` in a daemon thread; return (thread, box) where box holds the result or error."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # reported by the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_hanging_probe_never_delays_another_backend(make_plugin, only_cpu_real, cpu, monkeypatch) -> None:
    """While one thread waits on a hanging availability(), get_backend('cpu') in another returns at once."""
    monkeypatch.setenv("HAL_PROBE_TIMEOUT_S", "30")
    plugin = make_plugin("hanging", HANGING)
    only_cpu_real()
    waiter, _ = _in_thread(hal_core.get_backend, "hanging")
    deadline = time.monotonic() + 10
    while plugin.ran() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plugin.ran() == 1, "the hanging probe never started"
    other, box = _in_thread(hal_core.get_backend, "cpu")
    other.join(timeout=10)
    assert not other.is_alive(), "get_backend('cpu') waited on another backend's probe"
    assert box["result"].name == "cpu"
    assert waiter.is_alive()  # still inside its 30 s wait


def test_probe_past_the_time_limit_makes_the_backend_unavailable(make_plugin, only_cpu_real, monkeypatch) -> None:
    """A probe past HAL_PROBE_TIMEOUT_S reads as unavailable ('probe timed out after N s'); hal info returns."""
    monkeypatch.setenv("HAL_PROBE_TIMEOUT_S", "0.3")
    plugin = make_plugin("hanging", HANGING)
    only_cpu_real()
    start = time.monotonic()
    assert hal_core.get_backend().name == "cpu"  # automatic selection passes over it after the limit
    info = next(b for b in hal_core.list_backends() if b.name == "hanging")
    assert not info.available and info.reason == "probe timed out after 0.3 s"
    report = collect_info()
    assert report["selected"]["backend"] == "cpu"
    assert time.monotonic() - start < 10
    assert plugin.ran() == 1, "availability() ran more than once"


COUNTED_PROBE = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend, touch


class CountedBackend(HostBackend):
    name = "counted"
    priority = 4

    @classmethod
    def availability(cls):
        touch("{marker}")
        return super().availability()


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [CountedBackend]
'''


def test_availability_runs_once_per_backend_across_threads(make_plugin) -> None:
    """Sixteen threads listing and selecting at once: the probe ran exactly once."""
    plugin = make_plugin("counted", COUNTED_PROBE)
    threads = [_in_thread(hal_core.list_backends)[0] for _ in range(8)]
    threads += [_in_thread(hal_core.get_backend, "counted")[0] for _ in range(8)]
    for thread in threads:
        thread.join(timeout=30)
    assert plugin.ran() == 1


EXITING = '''
import sys

from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class ExitingBackend(HostBackend):
    name = "exiting"
    priority = 60

    @classmethod
    def availability(cls):
        {availability}
        return super().availability()

    def __init__(self):
        {init}


{module}


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    {backends}
    return [ExitingBackend]


@hookimpl
def hal_extra_ops(backend):
    {extra}
    return []
'''


def _exiting(where: str, statement: str = "sys.exit(3)") -> str:
    parts = {key: "pass" for key in ("availability", "init", "backends", "extra")}
    parts["module"] = ""
    parts[where] = statement
    return EXITING.format(**parts)


@pytest.mark.parametrize("where", ["module", "backends"], ids=["at-import", "in-hal_backends"])
def test_sys_exit_in_plugin_code_rejects_the_plugin(make_plugin, cpu, where: str) -> None:
    """sys.exit() at import or in a hook rejects that plugin with SystemExit as reason; the program goes on."""
    make_plugin("exiting", _exiting(where))
    record = next(p for p in hal_core.list_plugins() if p.name == "exiting")
    assert record.status == "rejected" and "SystemExit" in record.reason
    assert hal_core.get_backend("cpu").name == "cpu"


@pytest.mark.parametrize("statement", ["sys.exit(3)", "raise GeneratorExit()"], ids=["SystemExit", "GeneratorExit"])
@pytest.mark.parametrize("where", ["availability", "init"], ids=["in-availability", "in-__init__"])
def test_base_exceptions_in_availability_or_binding_make_the_backend_unavailable(make_plugin, only_cpu_real,
                                                                                 where: str, statement: str) -> None:
    """SystemExit or GeneratorExit from availability() or __init__ makes the backend unavailable, never exits."""
    make_plugin("exiting", _exiting(where, statement))
    only_cpu_real()
    with pytest.raises(hal_core.BackendUnavailableError) as info:
        hal_core.get_backend("exiting")
    assert statement.split("(")[0].split()[-1].replace("sys.exit", "SystemExit") in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert hal_core.get_backend().name == "cpu"


def test_sys_exit_in_hal_extra_ops_is_ignored(make_plugin, cpu) -> None:
    """A plugin whose hal_extra_ops calls sys.exit() never stops another backend from binding."""
    make_plugin("exiting", _exiting("extra"))
    hal_core.reset()
    assert hal_core.get_backend("cpu").name == "cpu"


KNOCKOFF_CPU = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class KnockoffCpu(HostBackend):
    name = "cpu"
    priority = {priority}


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [KnockoffCpu]
'''


@pytest.mark.parametrize("priority", [100, 0], ids=["higher-priority", "tie"])
def test_another_distribution_cannot_take_the_cpu_name(make_plugin, only_cpu_real, cpu, priority: int) -> None:
    """A plugin offering 'cpu' from another distribution is rejected with the reason; hal-cpu stays the cpu."""
    plugin = make_plugin("knockoff", KNOCKOFF_CPU.format(priority=priority))
    only_cpu_real()
    record = next(p for p in hal_core.list_plugins() if p.name == "knockoff")
    assert record.status == "rejected"
    assert "'cpu'" in record.reason and "hal-cpu" in record.reason and "HAL_ALLOW_OVERRIDE" in record.reason
    chosen = hal_core.get_backend()
    assert chosen.name == "cpu" and type(chosen).__module__.startswith("hal_cpu")
    assert type(hal_core.get_backend("cpu")).__module__ != plugin.module
    report = collect_info()
    assert any(p["name"] == "knockoff" and p["status"] == "rejected" for p in report["plugins"])


def test_allowed_override_may_replace_the_cpu_backend(make_plugin, only_cpu_real, cpu, monkeypatch) -> None:
    """HAL_ALLOW_OVERRIDE naming the plugin's distribution lets it replace hal-cpu's 'cpu', visibly."""
    plugin = make_plugin("knockoff", KNOCKOFF_CPU.format(priority=0))
    monkeypatch.setenv("HAL_ALLOW_OVERRIDE", plugin.distribution)
    only_cpu_real()
    assert type(hal_core.get_backend("cpu")).__module__ == plugin.module
    real = next(b for b in hal_core.list_backends() if b.distribution == "hal-cpu")
    assert not real.selectable and "HAL_ALLOW_OVERRIDE" in real.reason


ZERO_EXTRAS = '''
import numpy as np

from hal_core import API_VERSION, hookimpl
from hal_core.ops import OpImpl


def zeros(call):
    x, qweight = call["x"], call["qweight"]
    return np.zeros((x.shape[0], qweight.shape[1]), dtype=x.dtype)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_extra_ops(backend):
    if backend.name != "cpu":
        return []
    return [OpImpl("quantized_gemm", zeros, name="sneaky-zeros", priority=1000)]
'''


def _gemm_case() -> tuple[np.ndarray, object, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    qw = quantize(rng.standard_normal((64, 16)) / 8, group_size=32)
    return x, qw, OPS["quantized_gemm"].reference({"x": x, "qweight": qw})


def test_extra_ops_on_another_distributions_backend_are_refused(make_plugin, only_cpu_real, cpu, caplog) -> None:
    """hal_extra_ops adding a higher-priority implementation to hal-cpu is refused; results stay correct."""
    make_plugin("sneaky", ZERO_EXTRAS)
    only_cpu_real("")
    backend = hal_core.get_backend("cpu")
    assert "sneaky-zeros" not in [i.name for i in backend.ops.registry.implementations("quantized_gemm")]
    x, qw, expected = _gemm_case()
    np.testing.assert_allclose(backend.ops.quantized_gemm(x, qw), expected, rtol=1e-4, atol=1e-4)
    record = next(p for p in hal_core.list_plugins() if p.name == "sneaky")
    assert record.refused and "refused" in record.refused[0] and "HAL_ALLOW_OVERRIDE=hal-throwaway-sneaky" \
        in record.refused[0]
    report = collect_info()
    assert any(p["name"] == "sneaky" and p["refused"] for p in report["plugins"])


def test_extra_ops_allowed_by_name_are_used(make_plugin, only_cpu_real, cpu, monkeypatch) -> None:
    """With HAL_ALLOW_OVERRIDE naming the plugin's distribution, its extra implementation runs."""
    plugin = make_plugin("sneaky", ZERO_EXTRAS)
    monkeypatch.setenv("HAL_ALLOW_OVERRIDE", plugin.distribution)
    only_cpu_real()
    backend = hal_core.get_backend("cpu")
    x, qw, _ = _gemm_case()
    assert not backend.ops.quantized_gemm(x, qw).any()


BAD_AVAILABILITY = '''
from hal_core import API_VERSION, Availability, hookimpl
from halfakes import HostBackend


class OddBackend(HostBackend):
    name = "odd"
    priority = 70

    @classmethod
    def availability(cls):
        return {value}


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [OddBackend]
'''


@pytest.mark.parametrize("value", ["'no'", "('yes', 'fine')", "Availability('no')", "None", "(1, 'ok')",
                                   "Availability(True, 42)"],
                         ids=["string", "string-ok", "string-in-availability", "none", "int-ok", "int-reason"])
def test_availability_that_is_not_a_bool_and_a_reason_rejects_the_backend(make_plugin, only_cpu_real,
                                                                         value: str) -> None:
    """Anything but Availability(ok: bool, reason: str) reads as unavailable, saying what it returned."""
    make_plugin("odd", BAD_AVAILABILITY.format(value=value))
    only_cpu_real()
    info = next(b for b in hal_core.list_backends() if b.name == "odd")
    assert not info.available and "availability() returned" in info.reason
    assert hal_core.get_backend().name == "cpu"


def test_automatic_selection_failure_names_the_real_cause(make_plugin, monkeypatch) -> None:
    """With the real plugins disabled and a broken one left, the error names what that backend returned."""
    from importlib import metadata

    make_plugin("odd", BAD_AVAILABILITY.format(value="'no'"))
    real = {ep.name for ep in metadata.entry_points(group="hal") if not ep.value.startswith("hal_throwaway")}
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", ",".join(sorted(real)))
    hal_core.reset()
    with pytest.raises(hal_core.BackendUnavailableError) as info:
        hal_core.get_backend()
    assert "odd: availability() returned 'no'" in str(info.value)
