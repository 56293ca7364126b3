"""A wrong setting is an error at the first call that reads it: never a fallback, never a backend passed over."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from halfakes import subprocess_env

import hal_core
from hal_core import ConfigurationError, EnvironmentVariableError
from hal_core.ops import OPS
from hal_core.quant import quantize

TOP = 10**6  # above any real backend's priority

#: A backend whose quantized_gemm reads HAL_FAKE_TILE through the shared parser, in its kernel or its supports().
READS_A_SETTING = '''
from hal_core import API_VERSION, ConfigurationError, env, hookimpl
from halfakes import HostBackend, touch


def tile():
    return env.integer("HAL_FAKE_TILE", 64, minimum=1)


def gemm(call):
    touch("{marker}")
    if env.flag("HAL_FAKE_WRAP", False):
        try:
            tile()
        except ValueError as exc:
            raise RuntimeError("kernel set-up failed") from exc
    if env.flag("HAL_FAKE_OWN_ERROR", False):
        raise ConfigurationError("fake.toml: key 'tile' must be a power of two; fix the file")
    tile()
    return call.spec.reference(call.args).astype(call.spec.output_dtype(call.args))


def supports(call):
    return True if env.choice("HAL_FAKE_MODE", "fast", ("fast", "exact")) == "fast" else "exact mode asked"


class SettingBackend(HostBackend):
    name = "setting"
    priority = 5

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, priority=10, supports=supports, name="setting-gemm")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [SettingBackend]
'''


def _gemm_args(seed: int = 0) -> tuple[np.ndarray, hal_core.quant.QuantizedWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    qw = quantize(rng.standard_normal((64, 32)) / 8, group_size=32)
    return x, qw, OPS["quantized_gemm"].reference({"x": x, "qweight": qw})


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "nan", "0x2", "1,2", "0"])
def test_a_kernel_that_reads_a_bad_setting_raises_and_never_falls_back(make_plugin, monkeypatch, value) -> None:
    """The op raises EnvironmentVariableError naming the variable; ``out`` is untouched and no fallback ran."""
    plugin = make_plugin("setting", READS_A_SETTING)
    backend = hal_core.get_backend("setting")
    x, qw, ref = _gemm_args()
    monkeypatch.setenv("HAL_FAKE_TILE", value)
    out = np.full((8, 32), 7.0, np.float32)
    with backend.ops.watch() as events, pytest.raises(EnvironmentVariableError) as info:
        backend.ops.quantized_gemm(x, qw, out=out)
    assert (info.value.name, info.value.value) == ("HAL_FAKE_TILE", value)
    assert "HAL_FAKE_TILE" in str(info.value) and "an integer >= 1" in str(info.value)
    assert plugin.ran() == 1 and events == [] and (out == 7.0).all()
    assert hal_core.stats().get("setting", {}).get("quantized_gemm", {}).get("fallbacks", {}) == {}
    monkeypatch.setenv("HAL_FAKE_TILE", "32")  # fixed: the same backend now runs its kernel
    np.testing.assert_allclose(backend.ops.quantized_gemm(x, qw), ref, rtol=1e-5, atol=1e-5)
    assert plugin.ran() == 2


def test_a_supports_that_reads_a_bad_setting_raises(make_plugin, monkeypatch) -> None:
    """A supports() refusing a setting raises the error instead of counting as 'unsupported'."""
    plugin = make_plugin("setting", READS_A_SETTING)
    backend = hal_core.get_backend("setting")
    x, qw, _ = _gemm_args()
    monkeypatch.setenv("HAL_FAKE_MODE", "fastest")
    with pytest.raises(EnvironmentVariableError, match=r"HAL_FAKE_MODE='fastest'.*one of fast, exact"):
        backend.ops.quantized_gemm(x, qw)
    with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_MODE"):
        backend.ops.explain(backend.ops.prepare("quantized_gemm", x=x, qweight=qw))
    assert plugin.ran() == 0


def test_a_bad_setting_wrapped_by_the_plugin_still_surfaces(make_plugin, monkeypatch) -> None:
    """A plugin that wraps the setting's error in its own exception still raises the setting's error."""
    make_plugin("setting", READS_A_SETTING)
    backend = hal_core.get_backend("setting")
    x, qw, _ = _gemm_args()
    monkeypatch.setenv("HAL_FAKE_WRAP", "1")
    monkeypatch.setenv("HAL_FAKE_TILE", "many")
    with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_TILE='many'"):
        backend.ops.quantized_gemm(x, qw)


def test_a_plugins_own_configuration_error_is_raised(make_plugin, monkeypatch) -> None:
    """Any ConfigurationError (here a plugin's own, about its config file) reaches the caller as raised."""
    make_plugin("setting", READS_A_SETTING)
    x, qw, _ = _gemm_args()
    monkeypatch.setenv("HAL_FAKE_OWN_ERROR", "1")
    with pytest.raises(ConfigurationError, match=r"fake\.toml: key 'tile'") as info:
        hal_core.get_backend("setting").ops.quantized_gemm(x, qw)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, EnvironmentVariableError)


def test_a_bad_setting_is_raised_under_strict_too(make_plugin, monkeypatch) -> None:
    """HAL_STRICT=1 does not turn a setting error into an ImplementationError: the setting is named."""
    make_plugin("setting", READS_A_SETTING)
    x, qw, _ = _gemm_args()
    monkeypatch.setenv("HAL_STRICT", "1")
    monkeypatch.setenv("HAL_FAKE_TILE", "abc")
    with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_TILE"):
        hal_core.get_backend("setting").ops.quantized_gemm(x, qw)


def test_a_real_failure_still_falls_back(make_plugin, monkeypatch) -> None:
    """What a backend cannot run still falls back with a correct result: only settings are raised."""
    plugin = make_plugin("setting", READS_A_SETTING)
    backend = hal_core.get_backend("setting")
    x, qw, ref = _gemm_args(seed=3)
    monkeypatch.setenv("HAL_FAKE_MODE", "exact")  # a valid value the kernel does not support
    np.testing.assert_allclose(backend.ops.quantized_gemm(x, qw), ref, rtol=1e-4, atol=1e-4)
    used = hal_core.stats()["setting"]["quantized_gemm"]
    assert plugin.ran() == 0 and "setting-gemm" not in used["implementations"]
    assert list(used["fallbacks"]) == ["setting-gemm: exact mode asked"]


#: Runs in a fresh interpreter: hal-cpu reads HAL_CPU_THREADS once per process, when its first op runs.
CPU_THREADS_SCRIPT = '''
import os
import numpy as np
import hal_core
from hal_core.quant import quantize
from hal_core.testing.inputs import paged_attention_inputs

rng = np.random.default_rng(11)
x = rng.standard_normal((8, 64)).astype(np.float32)
qw = quantize(rng.standard_normal((64, 32)) / 8, group_size=32)
att = paged_attention_inputs(rng, seq_lens=[9, 3], num_heads=2, num_kv_heads=1, head_size=64, block_size=8,
                             dtype="fp32")
cpu = hal_core.get_backend()
assert cpu.name == "cpu", cpu.name
calls = [
    lambda: cpu.ops.quantized_gemm(x, qw),
    lambda: cpu.ops.paged_attention(att["query"], att["key_cache"], att["value_cache"], att["block_tables"],
                                    att["seq_lens"], scale=att["scale"]),
]
for value in ["abc", "-1", "1.5", "nan", "0x2", "1,2"]:
    os.environ["HAL_CPU_THREADS"] = value
    for call in calls:
        try:
            call()
        except hal_core.EnvironmentVariableError as exc:
            assert (exc.name, exc.value) == ("HAL_CPU_THREADS", value), (exc.name, exc.value)
            assert "an integer" in str(exc), str(exc)
        else:
            raise AssertionError(f"HAL_CPU_THREADS={value!r} did not raise")
assert hal_core.stats() == {}, hal_core.stats()  # no call ran, on the fallback path or elsewhere
os.environ["HAL_CPU_THREADS"] = "1"
expected = hal_core.ops.OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
np.testing.assert_allclose(calls[0](), expected, rtol=1e-4, atol=1e-4)
calls[1]()
used = hal_core.stats()["cpu"]
assert all("reference" not in used[op]["implementations"] for op in used), used
print("ok")
'''


def test_bad_hal_cpu_threads_raises_from_every_op_end_to_end(cpu) -> None:
    """HAL_CPU_THREADS=abc (and -1, 1.5, nan, 0x2, 1,2) makes each hal-cpu op raise naming it; no fallback runs."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CPU_THREADS_SCRIPT)], env=_only_cpu_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _only_cpu_env() -> dict[str, str]:
    from importlib import metadata

    env = subprocess_env()
    others = sorted({ep.name for ep in metadata.entry_points(group="hal")} - {"cpu"})
    if others:
        env["HAL_DISABLE_PLUGINS"] = ",".join(others)
    env.pop("HAL_CPU_THREADS", None)
    return env


#: A backend whose probe, or constructor, reads HAL_FAKE_DEVICES: a setting of the user's.
PROBE_READS_A_SETTING = '''
from hal_core import API_VERSION, Availability, env, hookimpl
from halfakes import HostBackend, touch


class ProbingBackend(HostBackend):
    name = "probing"
    priority = {priority}

    @classmethod
    def availability(cls):
        touch("{marker}", "p")
        if env.flag("HAL_FAKE_IN_PROBE", True):
            env.integer("HAL_FAKE_DEVICES", 1, minimum=1)
        return Availability(True)

    def __init__(self):
        touch("{marker}", "i")
        env.integer("HAL_FAKE_DEVICES", 1, minimum=1)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [ProbingBackend]
'''


@pytest.mark.parametrize("where", ["probe", "constructor"])
def test_a_bad_setting_in_a_probe_or_binding_is_raised_not_passed_over(make_plugin, only_cpu_real, cpu,
                                                                       monkeypatch, where) -> None:
    """Automatic and named selection raise the setting's error rather than pass over to another backend."""
    make_plugin("probing", PROBE_READS_A_SETTING.replace("{priority}", str(TOP)))
    only_cpu_real()
    monkeypatch.setenv("HAL_FAKE_IN_PROBE", "1" if where == "probe" else "0")
    monkeypatch.setenv("HAL_FAKE_DEVICES", "two")
    for name in (None, "probing"):
        with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_DEVICES='two'"):
            hal_core.get_backend(name)
    monkeypatch.setenv("HAL_FAKE_DEVICES", "2")  # fixed: probed or bound again, no reset needed
    assert hal_core.get_backend().name == "probing"


def test_list_backends_reports_a_probes_bad_setting(make_plugin, monkeypatch) -> None:
    """list_backends() (and so `hal info`) shows the setting's error as the reason instead of raising."""
    make_plugin("probing", PROBE_READS_A_SETTING.replace("{priority}", "5"))
    monkeypatch.setenv("HAL_FAKE_DEVICES", "0")
    info = next(b for b in hal_core.list_backends() if b.name == "probing")
    assert not info.available
    assert info.reason.startswith("configuration error:") and "HAL_FAKE_DEVICES='0'" in info.reason


#: A plugin that reads HAL_FAKE_LEVEL when imported.
IMPORT_READS_A_SETTING = '''
from hal_core import API_VERSION, env, hookimpl
from halfakes import HostBackend

LEVEL = env.choice("HAL_FAKE_LEVEL", "low", ("low", "high"))


class LevelBackend(HostBackend):
    name = "level"
    priority = 10**6


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [LevelBackend]
'''


def test_a_bad_setting_read_at_import_rejects_the_plugin_and_selection_raises(make_plugin, monkeypatch) -> None:
    """The plugin is rejected with the setting named; get_backend() raises the setting's error, by name too."""
    make_plugin("level", IMPORT_READS_A_SETTING)
    make_plugin("other", priority=1)
    monkeypatch.setenv("HAL_FAKE_LEVEL", "medium")
    record = next(p for p in hal_core.list_plugins() if p.name == "level")
    assert record.status == "rejected" and "HAL_FAKE_LEVEL='medium'" in record.reason
    for name in (None, "level"):
        with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_LEVEL='medium'") as info:
            hal_core.get_backend(name)
        assert isinstance(info.value.__cause__, EnvironmentVariableError)  # the plugin's own traceback
    assert hal_core.get_backend("other").name == "other"  # the others still load


@pytest.mark.parametrize("variable", ["HAL_DISABLE_PLUGINS", "HAL_ALLOW_OVERRIDE"])
@pytest.mark.parametrize("value", ["a;b", "a b", "hal-x/y"])
def test_a_bad_name_list_raises_before_any_plugin_is_imported(make_plugin, monkeypatch, variable, value) -> None:
    """A name list with another separator than ',' raises, naming the variable, before any plugin code runs."""
    plugin = make_plugin("watched", "from halfakes import touch\ntouch('{marker}')\n")
    monkeypatch.setenv(variable, value)
    with pytest.raises(EnvironmentVariableError) as info:
        hal_core.list_plugins()
    assert info.value.name == variable and "comma-separated list of names" in str(info.value)
    with pytest.raises(EnvironmentVariableError, match=variable):
        hal_core.get_backend()
    assert plugin.ran() == 0


def test_hal_info_reports_a_bad_plugin_list_instead_of_a_traceback(make_plugin, monkeypatch, capsys) -> None:
    """`hal info` with a HAL_DISABLE_PLUGINS it cannot read prints the error naming it and exits 2."""
    from hal_core.cli import main

    make_plugin("extra")
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", "cuda;rocm")
    assert main(["info", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "HAL_DISABLE_PLUGINS='cuda;rocm'" in captured.err


def test_hal_info_shows_a_bad_probe_timeout_as_the_selection_error(make_plugin, monkeypatch, capsys) -> None:
    """A HAL_PROBE_TIMEOUT_S that is no number: get_backend() raises it, and `hal info` says so per backend."""
    from hal_core.cli import main

    make_plugin("extra")
    monkeypatch.setenv("HAL_PROBE_TIMEOUT_S", "soon")
    with pytest.raises(EnvironmentVariableError, match="HAL_PROBE_TIMEOUT_S='soon'"):
        hal_core.get_backend()
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selected"]["error"]["type"] == "EnvironmentVariableError"
    extra = next(b for b in info["backends"] if b["name"] == "extra")
    assert not extra["available"] and "HAL_PROBE_TIMEOUT_S='soon'" in extra["reason"]


#: A plugin whose hal_extra_ops hook reads HAL_FAKE_EXTRA while a backend is bound.
EXTRA_OPS_READ_A_SETTING = '''
from hal_core import API_VERSION, env, hookimpl


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return []


@hookimpl
def hal_extra_ops(backend):
    env.flag("HAL_FAKE_EXTRA", False)
    return []
'''


def test_a_bad_setting_read_by_hal_extra_ops_is_raised_when_binding(make_plugin, monkeypatch) -> None:
    """Binding raises the setting's error rather than binding the backend without the plugin's extras."""
    make_plugin("extras", EXTRA_OPS_READ_A_SETTING)
    make_plugin("target", priority=3)
    monkeypatch.setenv("HAL_FAKE_EXTRA", "sometimes")
    with pytest.raises(EnvironmentVariableError, match="HAL_FAKE_EXTRA='sometimes'"):
        hal_core.get_backend("target")
    monkeypatch.setenv("HAL_FAKE_EXTRA", "no")
    assert hal_core.get_backend("target").name == "target"
