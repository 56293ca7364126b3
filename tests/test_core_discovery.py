"""Discovery over real throwaway distributions: fault isolation, versions, names, disabling."""

from __future__ import annotations

import logging
import threading

import pytest

import hal_core
from hal_core import BackendConflictError
from hal_core._runtime import current


def discover():
    return current().discovery()


def _record(name: str) -> hal_core.PluginRecord:
    return next(p for p in hal_core.list_plugins() if p.name == name)


def _backend_names() -> set[str]:
    return {b.name for b in hal_core.list_backends()}


def test_plugin_with_missing_module_is_rejected_and_others_load(make_plugin) -> None:
    """An entry point whose module does not exist is rejected with the reason; other plugins still load."""
    make_plugin("ghost", write_module=False, module="hal_no_such_module_xyz")
    make_plugin("good")
    ghost = _record("ghost")
    assert ghost.status == "rejected"
    assert "hal_no_such_module_xyz" in ghost.reason and "ModuleNotFoundError" in ghost.reason
    assert _record("good").status == "loaded"
    assert "good" in _backend_names()


def test_plugin_whose_import_raises_is_rejected_with_traceback_at_debug(make_plugin, caplog) -> None:
    """A module that raises on import is rejected with its error; the traceback is logged at DEBUG."""
    make_plugin("boom", "raise RuntimeError('kaboom at import')\n")
    make_plugin("good")
    with caplog.at_level(logging.DEBUG, logger="hal"):
        records = {p.name: p for p in hal_core.list_plugins()}
    assert records["boom"].status == "rejected"
    assert "RuntimeError: kaboom at import" in records["boom"].reason
    assert records["good"].status == "loaded"
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert any("boom" in r.getMessage() for r in debug)


def test_real_cpu_plugin_loads_beside_a_broken_one(make_plugin, cpu) -> None:
    """A broken plugin never stops the real CPU plugin from loading."""
    make_plugin("boom", "raise ImportError('missing vendor SDK')\n")
    assert _record("boom").status == "rejected"
    assert _record("cpu").status == "loaded"
    assert hal_core.get_backend("cpu").name == "cpu"


HOOK_RAISES = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class RaisingBackend(HostBackend):
    name = "raising"
    priority = 10


@hookimpl
def hal_api_version():
    {version_body}


@hookimpl
def hal_backends():
    {backends_body}


@hookimpl
def hal_extra_ops(backend):
    raise AssertionError("a rejected plugin's hooks must never run")
'''


@pytest.mark.parametrize(
    ("version_body", "backends_body", "expected"),
    [
        ("raise RuntimeError('no version for you')", "return [RaisingBackend]", "hal_api_version raised"),
        ("return API_VERSION", "raise RuntimeError('no backends for you')", "hal_backends raised"),
    ],
    ids=["hal_api_version-raises", "hal_backends-raises"],
)
def test_hook_that_raises_rejects_the_plugin_whole(make_plugin, version_body, backends_body, expected) -> None:
    """A hook that raises rejects the plugin: no backend of it stays, and pluggy no longer holds it."""
    plugin = make_plugin("raising", HOOK_RAISES.format(version_body=version_body, backends_body=backends_body))
    make_plugin("good")
    record = _record("raising")
    assert record.status == "rejected"
    assert expected in record.reason and "for you" in record.reason
    assert "raising" not in _backend_names()
    manager = discover().manager
    assert manager.get_plugin("hal-plugin:raising") is None
    assert all(p.__name__ != plugin.module for p in manager.get_plugins() if hasattr(p, "__name__"))
    assert hal_core.get_backend("good").name == "good"  # binding good runs hal_extra_ops: raising's is gone


VERSIONED = '''
from hal_core import hookimpl
from halfakes import HostBackend, touch


@hookimpl
def hal_api_version():
    return {version}


@hookimpl
def hal_backends():
    class VersionedBackend(HostBackend):
        name = "versioned"
        priority = 10
        touch("{marker}", "body")

        @classmethod
        def availability(cls):
            touch("{marker}", "availability")
            return super().availability()

    return [VersionedBackend]
'''


@pytest.mark.parametrize("version", [(2, 0), (0, 9), (1, 99)], ids=["major-newer", "major-older", "minor-newer"])
def test_incompatible_api_version_is_rejected_before_backend_code_runs(make_plugin, version) -> None:
    """A plugin for another API major, or a newer minor, is refused with a RuntimeWarning naming both versions."""
    plugin = make_plugin("versioned", VERSIONED.replace("{version}", repr(version)))
    with pytest.warns(RuntimeWarning) as caught:
        record = _record("versioned")
    message = str(caught[0].message)
    assert f"{version[0]}.{version[1]}" in message
    assert "{}.{}".format(*hal_core.API_VERSION) in message
    assert record.status == "rejected"
    assert "versioned" not in _backend_names()
    assert plugin.ran() == 0, "backend code ran although the API version was refused"


def test_compatible_older_minor_is_accepted(make_plugin) -> None:
    """A plugin built for the same major and an older or equal minor binds."""
    plugin = make_plugin("versioned", VERSIONED.replace("{version}", repr((hal_core.API_VERSION[0], 0))))
    assert _record("versioned").status == "loaded"
    assert hal_core.get_backend("versioned").name == "versioned"
    assert plugin.ran() > 0


INCOMPLETE = '''
from hal_core import API_VERSION, Availability, Backend, hookimpl
from halfakes import FakeDevice


class IncompleteBackend(Backend):
    name = "incomplete"
    priority = 10

    @classmethod
    def availability(cls):
        return Availability(True)

    def devices(self):
        return [FakeDevice()]

    def register_ops(self, registry):
        pass

    def to_numpy(self, array):
        return array

    def asarray(self, array, device=None):
        return array


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [IncompleteBackend]
'''


def test_backend_with_abstract_method_missing_is_rejected_naming_it(make_plugin) -> None:
    """A backend class that leaves an abstract method out is rejected, and the reason names the method."""
    make_plugin("incomplete", INCOMPLETE)
    record = _record("incomplete")
    assert record.status == "rejected"
    assert "owns" in record.reason
    assert "incomplete" not in _backend_names()
    assert discover().manager.get_plugin("hal-plugin:incomplete") is None


def test_same_backend_name_from_two_distributions_without_an_owner_rejects_both(make_plugin) -> None:
    """Two distributions offering one name, neither named hal-<name>: both plugins are rejected, with the reason."""
    make_plugin("low", backend="dup", priority=5)
    make_plugin("high", backend="dup", priority=7)
    for name in ("low", "high"):
        record = _record(name)
        assert record.status == "rejected"
        assert "may not replace another distribution's backend" in record.reason
        assert "HAL_ALLOW_OVERRIDE=hal-throwaway-" in record.reason
    assert "dup" not in _backend_names()
    with pytest.raises(hal_core.BackendUnavailableError, match="plugin was rejected"):
        hal_core.get_backend("dup")


def test_allowed_override_replaces_the_owner(make_plugin, monkeypatch) -> None:
    """HAL_ALLOW_OVERRIDE=dist: that distribution's backend replaces the owner's; the owner shows as replaced."""
    make_plugin("owner", backend="dup", priority=9, distribution="hal-dup")
    other = make_plugin("other", backend="dup", priority=1)
    monkeypatch.setenv("HAL_ALLOW_OVERRIDE", other.distribution)
    hal_core.reset()
    backend = hal_core.get_backend("dup")
    assert type(backend).__module__ == other.module
    owner = next(b for b in hal_core.list_backends() if b.plugin == "owner")
    assert not owner.selectable and "replaced by distribution hal-throwaway-other" in owner.reason


TWO_OF_A_NAME = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class LowBackend(HostBackend):
    name = "dup"
    priority = 5


class HighBackend(HostBackend):
    name = "dup"
    priority = {high}


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [LowBackend, HighBackend]
'''


def test_one_distribution_offering_a_name_twice_higher_priority_wins(make_plugin) -> None:
    """One distribution offering one name twice: the higher priority holds it, the other is shadowed."""
    make_plugin("maker", TWO_OF_A_NAME.replace("{high}", "7"))
    infos = [b for b in hal_core.list_backends() if b.name == "dup"]
    assert sorted((b.priority, b.selectable) for b in infos) == [(5, False), (7, True)]
    loser = next(b for b in infos if b.priority == 5)
    assert "shadowed" in loser.reason and "maker" in loser.reason
    backend = hal_core.get_backend("dup")
    assert type(backend).__name__ == "HighBackend" and backend.priority == 7


def test_same_backend_name_at_equal_priority_in_one_distribution_is_a_conflict(make_plugin) -> None:
    """An exact priority tie within one distribution: get_backend(name) raises BackendConflictError."""
    make_plugin("maker", TWO_OF_A_NAME.replace("{high}", "5"))
    with pytest.raises(BackendConflictError, match=r"conflict.*'dup'"):
        hal_core.get_backend("dup")
    assert all(not b.selectable for b in hal_core.list_backends() if b.name == "dup")


SIDE_EFFECT = '''
from halfakes import touch

touch("{marker}")
raise AssertionError("a disabled plugin must never be imported")
'''


def test_disabled_plugins_are_never_imported(make_plugin, monkeypatch) -> None:
    """HAL_DISABLE_PLUGINS=a,b: those entry points are recorded as disabled and their modules never run."""
    a = make_plugin("a", SIDE_EFFECT)
    b = make_plugin("b", SIDE_EFFECT)
    make_plugin("c")
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", " a, b ")
    hal_core.reset()
    records = {p.name: p for p in hal_core.list_plugins()}
    assert records["a"].status == records["b"].status == "disabled"
    assert "HAL_DISABLE_PLUGINS" in records["a"].reason
    assert records["c"].status == "loaded"
    assert a.ran() == b.ran() == 0


RAISING_AVAILABILITY = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class SulkyBackend(HostBackend):
    name = "sulky"
    priority = 10

    @classmethod
    def availability(cls):
        raise OSError("driver library libfoo.so not found")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [SulkyBackend]
'''


def test_availability_that_raises_reads_as_unavailable_with_reason(make_plugin) -> None:
    """availability() raising makes the backend unavailable, with the error as its reason."""
    make_plugin("sulky", RAISING_AVAILABILITY)
    info = next(b for b in hal_core.list_backends() if b.name == "sulky")
    assert not info.available
    assert "OSError" in info.reason and "libfoo.so" in info.reason


COUNTED_IMPORT = '''
import time

from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend, touch

touch("{marker}")
time.sleep(0.05)  # widen the window in which a second import could start


class CountedBackend(HostBackend):
    name = "counted"
    priority = 10


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [CountedBackend]
'''


def test_concurrent_first_use_discovers_once(make_plugin) -> None:
    """Many threads calling list_backends() at once import each plugin module exactly once."""
    plugin = make_plugin("counted", COUNTED_IMPORT)
    barrier = threading.Barrier(16)
    results: list[set[str]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            results.append({b.name for b in hal_core.list_backends()})
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 16 and all("counted" in names for names in results)
    assert plugin.ran() == 1


def test_reset_forgets_discovery_and_bound_backends(make_plugin) -> None:
    """reset() makes the next call rediscover plugins and bind fresh backend instances."""
    make_plugin("early")
    first = hal_core.get_backend("early")
    assert hal_core.get_backend("early") is first
    hal_core.reset()
    assert hal_core.get_backend("early") is not first


def test_discovery_is_cached_until_reset(make_plugin, site) -> None:
    """A plugin installed after discovery stays unseen until reset()."""
    make_plugin("early")
    assert "early" in _backend_names()
    info = site / "hal_throwaway_later-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hal-throwaway-later\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[hal]\nlater = hal_throwaway_early\n")
    assert all(p.name != "later" for p in hal_core.list_plugins())
    hal_core.reset()
    assert any(p.name == "later" for p in hal_core.list_plugins())


def test_plugin_record_names_distribution_and_version(make_plugin) -> None:
    """Each record carries the entry point, its distribution, version and backends."""
    make_plugin("named", version="3.1.4", distribution="hal-named-plugin")
    record = _record("named")
    assert (record.distribution, record.version, record.backends) == ("hal-named-plugin", "3.1.4", ["named"])
    info = next(b for b in hal_core.list_backends() if b.name == "named")
    assert (info.distribution, info.version, info.plugin) == ("hal-named-plugin", "3.1.4", "named")


JUNK_EXTRAS = '''
from hal_core import API_VERSION, hookimpl


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_extra_ops(backend):
    return ["not an OpImpl"]
'''


def test_junk_extra_ops_never_break_another_backend(make_plugin, cpu, caplog) -> None:
    """hal_extra_ops returning something that is not an OpImpl is ignored with a warning; cpu still binds."""
    make_plugin("junk", JUNK_EXTRAS)
    hal_core.reset()
    with caplog.at_level(logging.WARNING, logger="hal"):
        backend = hal_core.get_backend("cpu")
    assert backend.name == "cpu"
    assert any("hal_extra_ops" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)


def test_two_entry_points_with_one_name_reject_the_second_with_the_reason(make_plugin) -> None:
    """Two distributions registering the same entry-point name: the second is rejected, naming the first."""
    make_plugin("twin", module="hal_twin_a", distribution="hal-twin-a", backend="twin_a")
    make_plugin("twin", module="hal_twin_b", distribution="hal-twin-b", backend="twin_b")
    records = [p for p in hal_core.list_plugins() if p.name == "twin"]
    assert [r.status for r in records] == ["loaded", "rejected"]
    assert "already taken" in records[1].reason and records[0].value in records[1].reason


SLOW_INIT = '''
import time
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class SlowBackend(HostBackend):
    name = "slow"
    priority = 5

    def __init__(self):
        time.sleep(0.3)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [SlowBackend]
'''


def test_reset_during_binding_does_not_deadlock(make_plugin) -> None:
    """reset() from one thread while another binds a backend: both finish (the locks never cross)."""
    make_plugin("slow", SLOW_INIT)
    hal_core.list_backends()
    binder = threading.Thread(target=hal_core.get_backend, args=("slow",), daemon=True)
    resetter = threading.Thread(target=hal_core.reset, daemon=True)
    binder.start()
    resetter.start()
    binder.join(timeout=30)
    resetter.join(timeout=30)
    assert not binder.is_alive() and not resetter.is_alive(), "get_backend and reset deadlocked"
