"""Backend selection: explicit name, HAL_BACKEND, priority, errors, warnings, laziness."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from halfakes import subprocess_env

import hal_core
from hal_core import BackendNotFoundError, BackendUnavailableError

TOP = 10**6  # above any real backend's priority

UNAVAILABLE = '''
from hal_core import API_VERSION, Availability, hookimpl
from halfakes import HostBackend


class AbsentBackend(HostBackend):
    name = "absent"
    priority = {priority}

    @classmethod
    def availability(cls):
        return Availability(False, "no Absent device found", "install the Absent driver")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [AbsentBackend]
'''

FAILS_TO_INIT = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class BrokenBackend(HostBackend):
    name = "broken"
    priority = {priority}

    def __init__(self):
        raise RuntimeError("device context creation failed")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [BrokenBackend]
'''


def test_explicit_name_wins_over_priority(make_plugin) -> None:
    """get_backend(name) returns that backend even when another has a higher priority."""
    make_plugin("low", priority=1)
    make_plugin("high", priority=TOP)
    assert hal_core.get_backend("low").name == "low"


def test_hal_backend_variable_selects(make_plugin, monkeypatch) -> None:
    """HAL_BACKEND names the backend get_backend() returns when given no name."""
    make_plugin("low", priority=1)
    make_plugin("high", priority=TOP)
    monkeypatch.setenv("HAL_BACKEND", "low")
    assert hal_core.get_backend().name == "low"


def test_highest_priority_available_wins(make_plugin) -> None:
    """Automatic selection returns the available backend with the highest priority."""
    make_plugin("absent", UNAVAILABLE.replace("{priority}", str(TOP + 1)))
    make_plugin("second", priority=TOP)
    make_plugin("third", priority=TOP - 1)
    assert hal_core.get_backend().name == "second"


def test_hal_backend_nonexistent_raises_not_found(make_plugin, monkeypatch) -> None:
    """HAL_BACKEND naming no installed backend raises BackendNotFoundError listing the installed ones."""
    make_plugin("real")
    monkeypatch.setenv("HAL_BACKEND", "nonexistent")
    with pytest.raises(BackendNotFoundError) as info:
        hal_core.get_backend()
    assert isinstance(info.value, LookupError)
    assert "nonexistent" in str(info.value) and "real" in str(info.value)


def test_hal_backend_unavailable_raises_with_reason_and_remedy(make_plugin, monkeypatch) -> None:
    """HAL_BACKEND naming an unavailable backend raises BackendUnavailableError with reason and remedy."""
    make_plugin("absent", UNAVAILABLE.replace("{priority}", "5"))
    monkeypatch.setenv("HAL_BACKEND", "absent")
    with pytest.raises(BackendUnavailableError) as info:
        hal_core.get_backend()
    assert info.value.reason == "no Absent device found"
    assert info.value.remedy == "install the Absent driver"
    assert "no Absent device found" in str(info.value) and "install the Absent driver" in str(info.value)


def test_explicit_name_that_fails_to_initialise_raises(make_plugin) -> None:
    """An explicit choice whose constructor fails raises BackendUnavailableError naming the failure."""
    make_plugin("broken", FAILS_TO_INIT.replace("{priority}", "5"))
    with pytest.raises(BackendUnavailableError, match="device context creation failed"):
        hal_core.get_backend("broken")
    info = next(b for b in hal_core.list_backends() if b.name == "broken")
    assert not info.available and "device context creation failed" in info.reason


def test_rejected_plugin_named_explicitly_says_why(make_plugin) -> None:
    """Asking for a rejected plugin's name raises BackendUnavailableError carrying the rejection."""
    make_plugin("boom", "raise RuntimeError('kaboom')\n")
    with pytest.raises(BackendUnavailableError, match="kaboom"):
        hal_core.get_backend("boom")


def test_auto_selection_passes_over_a_failing_backend_and_warns_once(make_plugin, only_cpu_real, cpu) -> None:
    """A failing top-priority backend is passed over with one RuntimeWarning; the CPU backend is returned."""
    make_plugin("broken", FAILS_TO_INIT.replace("{priority}", str(TOP)))
    only_cpu_real()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = hal_core.get_backend()
        second = hal_core.get_backend()
    assert first.name == second.name == "cpu"
    relevant = [w for w in caught if issubclass(w.category, RuntimeWarning) and "broken" in str(w.message)]
    assert len(relevant) == 1, [str(w.message) for w in caught]
    assert "device context creation failed" in str(relevant[0].message)


def test_auto_selection_without_cpu_and_nothing_available_raises(make_plugin, monkeypatch) -> None:
    """With every plugin disabled and nothing available, automatic selection raises, naming hal-cpu."""
    from importlib import metadata

    make_plugin("absent", UNAVAILABLE.replace("{priority}", "5"))
    real = {ep.name for ep in metadata.entry_points(group="hal") if ep.name != "absent"}
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", ",".join(sorted(real)) or "none")
    hal_core.reset()
    with pytest.raises(BackendUnavailableError, match="hal-cpu"):
        hal_core.get_backend()


def test_several_backends_usable_in_one_process(make_plugin) -> None:
    """Two backends bound side by side each run ops and return correct results."""
    make_plugin("one", priority=1)
    make_plugin("two", priority=2)
    one, two = hal_core.get_backend("one"), hal_core.get_backend("two")
    assert one is not two and hal_core.get_backend("one") is one
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    qw = hal_core.quant.quantize(rng.standard_normal((64, 16)), group_size=32)
    a, b = one.ops.quantized_gemm(x, qw), two.ops.quantized_gemm(x, qw)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    loaded = {i.name for i in hal_core.list_backends() if i.loaded}
    assert {"one", "two"} <= loaded


def test_import_is_lazy() -> None:
    """import hal_core imports no plugin and no vendor SDK (checked in a fresh interpreter)."""
    code = ("import sys, hal_core; "
            "bad = [m for m in ('hal_cpu', 'hal_cuda', 'cupy', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(), timeout=60)


def test_availability_is_side_effect_free() -> None:
    """Asking every installed backend whether it is available changes no env variable and imports no SDK."""
    code = """
import os, sys
import hal_core
before = dict(os.environ)
mods = set(sys.modules)
infos = hal_core.list_backends()
assert dict(os.environ) == before, "availability() changed the environment"
new = {m.split('.')[0] for m in set(sys.modules) - mods}
bad = sorted(new & {'cupy', 'cupy_backends', 'torch', 'pycuda', 'jax', 'cuda'})
assert not bad, f"availability() imported {bad}"
print(len(infos))
"""
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_disabled_cpu_plugin_is_named_with_how_to_re_enable_it(make_plugin, cpu, monkeypatch) -> None:
    """HAL_DISABLE_PLUGINS=cpu: the error says the plugin was disabled and how to re-enable it, not to install it."""
    from importlib import metadata

    make_plugin("absent", UNAVAILABLE.replace("{priority}", "5"))
    real = sorted(ep.name for ep in metadata.entry_points(group="hal") if ep.name != "absent")
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", ",".join(real))
    hal_core.reset()
    with pytest.raises(BackendUnavailableError) as info:
        hal_core.get_backend()
    assert "plugin 'cpu' (hal-cpu) is disabled by HAL_DISABLE_PLUGINS" in info.value.reason
    assert "absent: no Absent device found" in info.value.reason
    assert f"HAL_DISABLE_PLUGINS (now {','.join(real)!r}) or unsetting it" in info.value.remedy
    assert "'cpu'" in info.value.remedy and "pip install" not in info.value.remedy
    with pytest.raises(BackendUnavailableError) as named:
        hal_core.get_backend("cpu")
    assert "disabled by HAL_DISABLE_PLUGINS" in named.value.reason
    assert "remove 'cpu' from HAL_DISABLE_PLUGINS" in named.value.remedy
    monkeypatch.delenv("HAL_DISABLE_PLUGINS")
    hal_core.reset()  # re-enabled: discovery runs again
    assert hal_core.get_backend("cpu").name == "cpu"


def test_nothing_disabled_and_nothing_available_advises_installing_the_fallback() -> None:
    """With no plugin disabled, the remedy is to install (or repair) hal-cpu; a disabled one is named first."""
    from hal_core import _selection

    assert "pip install hal-cpu" in _selection._nothing_available_remedy([])
    other = hal_core.PluginRecord("gpu", "x:y", "hal-gpu", "1.0", "disabled")
    remedy = _selection._nothing_available_remedy([other])
    assert remedy.index("re-enable 'gpu'") < remedy.index("pip install hal-cpu")
