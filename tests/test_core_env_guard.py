"""Plugin code that changes a HAL_* variable is refused whole, and the user's environment is put back."""

from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import pytest

import hal_core
from hal_core import _env, _env_guard
from hal_core._env_guard import watch
from hal_core.cli import collect_info
from hal_core.testing.inputs import paged_attention_inputs

#: A plugin that switches the index checks off and HAL_STRICT off in the one place named by WHERE.
TAMPERING = '''
import os

from hal_core import API_VERSION, Availability, hookimpl
from halfakes import HostBackend

WHERE = {where!r}


def tamper(place):
    if place == WHERE:
        os.environ["HAL_CHECK_INDICES"] = "0"
        os.environ.pop("HAL_STRICT", None)


tamper("import")


class TamperingBackend(HostBackend):
    name = "tampering"
    priority = 10**6

    @classmethod
    def availability(cls):
        tamper("availability")
        return Availability(True)

    def __init__(self):
        tamper("init")


@hookimpl
def hal_api_version():
    tamper("hal_api_version")
    return API_VERSION


@hookimpl
def hal_backends():
    tamper("hal_backends")
    return [TamperingBackend]


@hookimpl
def hal_extra_ops(backend):
    tamper("hal_extra_ops")
    return []
'''

PLACES = ["import", "hal_api_version", "hal_backends", "availability", "init", "hal_extra_ops"]


def _record(name: str) -> hal_core.PluginRecord:
    return next(p for p in hal_core.list_plugins() if p.name == name)


def _bad_block_table_call(backend: hal_core.Backend) -> None:
    rng = np.random.default_rng(5)
    args = paged_attention_inputs(rng, seq_lens=[9], num_heads=2, num_kv_heads=1, head_size=64, block_size=8,
                                  dtype="fp32")
    args["block_tables"][0, 0] = 10**6  # out of range: the host checks must refuse it
    backend.ops.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                args["seq_lens"], scale=args["scale"])


@pytest.mark.parametrize("where", PLACES)
def test_a_plugin_that_changes_hal_settings_is_refused_and_undone(make_plugin, only_cpu_real, cpu, monkeypatch,
                                                                  where) -> None:
    """Wherever its code sets HAL_CHECK_INDICES=0 (or unsets HAL_STRICT), the plugin is rejected whole."""
    make_plugin("tampering", TAMPERING.format(where=where))
    only_cpu_real()
    monkeypatch.setenv("HAL_STRICT", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the passed-over plugin is warned about
        chosen = hal_core.get_backend()
    assert chosen.name == "cpu"
    assert "HAL_CHECK_INDICES" not in os.environ and os.environ.get("HAL_STRICT") == "1"
    record = _record("tampering")
    assert record.status == "rejected"
    assert "HAL_CHECK_INDICES from unset to '0'" in record.reason and "HAL_STRICT from '1' to unset" in record.reason
    assert "tampering" not in {b.name for b in hal_core.list_backends()}
    with pytest.raises(hal_core.BackendUnavailableError, match="HAL_CHECK_INDICES"):
        hal_core.get_backend("tampering")
    assert _record("cpu").status == "loaded"
    assert _env.check_indices()
    with pytest.raises(hal_core.ArgumentError, match="block_tables"):
        _bad_block_table_call(chosen)


def test_hal_info_shows_a_plugin_refused_by_its_probe(make_plugin, only_cpu_real, cpu) -> None:
    """hal info lists a plugin whose availability() changed a HAL_* variable as rejected, with the reason."""
    make_plugin("tampering", TAMPERING.format(where="availability"))
    only_cpu_real()
    info = collect_info()
    plugin = next(p for p in info["plugins"] if p["name"] == "tampering")
    assert plugin["status"] == "rejected" and "HAL_CHECK_INDICES" in plugin["reason"]
    assert info["selected"] == {"backend": "cpu", "error": None}
    assert "HAL_CHECK_INDICES" not in os.environ


#: A plugin whose probe waits, so the user's own thread can change a variable while it runs.
PATIENT = '''
import os
import time

from hal_core import API_VERSION, Availability, hookimpl
from halfakes import HostBackend, touch


class PatientBackend(HostBackend):
    name = "patient"
    priority = 5

    @classmethod
    def availability(cls):
        touch("{marker}")
        deadline = time.monotonic() + 30
        while not os.path.exists("{marker}.release") and time.monotonic() < deadline:
            time.sleep(0.005)
        return Availability(True)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [PatientBackend]
'''


def test_the_users_own_change_during_a_probe_is_neither_blamed_nor_undone(make_plugin, monkeypatch) -> None:
    """A HAL_* variable the user sets in their own thread while a probe runs stays set; the plugin stays loaded."""
    plugin = make_plugin("patient", PATIENT)
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.setdefault("backend", hal_core.get_backend("patient")),
                              daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while plugin.ran() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert plugin.ran() == 1, "the probe never started"
    monkeypatch.setenv("HAL_STRICT", "1")  # the user's own change, while the probe runs
    plugin.marker.with_name(plugin.marker.name + ".release").touch()
    waiter.join(30)
    assert box["backend"].name == "patient"
    assert os.environ.get("HAL_STRICT") == "1" and _record("patient").status == "loaded"


def test_watch_puts_back_only_what_its_own_thread_changed(monkeypatch) -> None:
    """Writes of the watched thread are undone and reported; another thread's writes, and non-HAL ones, stay."""
    monkeypatch.setenv("HAL_TUNE", "1")
    monkeypatch.delenv("HAL_FAKE_OTHER", raising=False)
    monkeypatch.delenv("HAL_FAKE_SAME", raising=False)
    monkeypatch.setenv("HAL_FAKE_KEEP", "x")
    monkeypatch.setenv("NOT_HAL", "a")

    def other_thread() -> None:
        os.environ["HAL_FAKE_OTHER"] = "theirs"

    already_open = _env_guard._open_watches  # e.g. a hanging probe of an earlier test, still watched
    with watch() as changes:
        assert type(os.environ) is not os._Environ  # recording while a watch is open
        os.environ.update({"HAL_TUNE": "0", "NOT_HAL": "b"})
        os.environ.setdefault("HAL_FAKE_SAME", "tmp")
        del os.environ["HAL_FAKE_SAME"]  # set and unset again: no change in the end
        os.environ["HAL_FAKE_KEEP"] = "x"  # the same value: no change
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert [(c.name, c.before, c.after) for c in changes] == [("HAL_TUNE", "1", "0")]
    assert os.environ["HAL_TUNE"] == "1" and os.environ["NOT_HAL"] == "b"
    assert os.environ["HAL_FAKE_OTHER"] == "theirs" and os.environ["HAL_FAKE_KEEP"] == "x"
    monkeypatch.delenv("HAL_FAKE_OTHER")
    assert _env_guard._open_watches == already_open
    assert (type(os.environ) is os._Environ) == (already_open == 0)  # its own class again once none is open


def test_nested_watches_report_each_its_own_writes(monkeypatch) -> None:
    """An inner watch reports and undoes its writes; putting them back is no write of the outer one."""
    monkeypatch.delenv("HAL_FAKE_A", raising=False)
    monkeypatch.delenv("HAL_FAKE_B", raising=False)
    with watch() as outer:
        os.environ["HAL_FAKE_A"] = "outer"
        with watch() as inner:
            os.environ["HAL_FAKE_B"] = "inner"
            os.environ["HAL_FAKE_A"] = "inner"
        assert os.environ["HAL_FAKE_A"] == "outer" and "HAL_FAKE_B" not in os.environ
    assert {(c.name, c.before, c.after) for c in inner} == {("HAL_FAKE_B", None, "inner"),
                                                           ("HAL_FAKE_A", "outer", "inner")}
    assert [(c.name, c.before, c.after) for c in outer] == [("HAL_FAKE_A", None, "outer")]
    assert "HAL_FAKE_A" not in os.environ
