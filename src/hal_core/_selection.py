"""Choosing a backend: by name, by ``HAL_BACKEND``, or the best available.

A :class:`~hal_core.ConfigurationError` is never a reason to pick another
backend: when a plugin's import, probe or binding refuses a setting of the
user's, selection raises it. An error when nothing is available names
every cause, plugins disabled by ``HAL_DISABLE_PLUGINS`` included.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any

from . import _env
from ._backend import Availability, Backend
from ._discovery import BackendEntry, Discovery, PluginRecord, _normalise
from ._errors import BackendConflictError, BackendNotFoundError, BackendUnavailableError, ConfigurationError
from ._runtime import Runtime, current

__all__ = ["BackendInfo", "check_errors", "get_backend", "list_backends", "stats"]

log = logging.getLogger("hal")


@dataclass(frozen=True)
class BackendInfo:
    """What ``list_backends()`` reports for one backend offered by a loaded plugin."""

    name: str
    distribution: str
    version: str
    priority: int
    plugin: str
    loaded: bool
    available: bool
    reason: str
    remedy: str = ""
    selectable: bool = True
    #: True for the backend every other one falls back to (the lowest-priority available host backend).
    fallback: bool = False


def get_backend(name: str | None = None) -> Backend:
    """The backend to use: ``name``, else ``HAL_BACKEND``, else the best available one.

    An explicit choice that cannot run raises :class:`BackendNotFoundError`,
    :class:`BackendConflictError` or :class:`BackendUnavailableError` (with
    reason and remedy). Automatic selection never raises while an available
    host backend (hal-cpu) is installed, except for a wrong setting: it warns
    once when it passes over an installed backend that failed, and its error
    names every cause. A :class:`~hal_core.ConfigurationError` (a ``HAL_*``
    variable a plugin read and refused) is raised as it is, never passed over.
    """
    explicit = name or _env.backend_override()
    runtime = current()
    if explicit:
        return _get_named(runtime, explicit)
    discovery = runtime.discovery()
    for error in discovery.setting_errors.values():
        raise _fresh(error) from error
    candidates = runtime.selectable()
    for entry in candidates:  # every probe runs at once; the walk below waits in priority order
        runtime.start_probe(entry)
    causes = []
    for entry in candidates:
        availability = runtime.availability(entry)
        if not availability.ok:
            causes.append(f"{entry.name}: {availability.reason}")
            if entry.name in runtime.failed:
                _warn_passed_over(runtime, entry.name, availability.reason)
            else:
                log.info("hal: skipping backend %r: %s", entry.name, availability.reason)
            continue
        try:
            return runtime.bind(entry)
        except BackendUnavailableError as exc:
            causes.append(f"{entry.name}: {exc.reason}")
            _warn_passed_over(runtime, entry.name, exc.reason)
    for entry in discovery.backends:
        if entry.shadowed:
            causes.append(f"{entry.name} ({entry.distribution}): {entry.shadowed}")
    for record in discovery.plugins:
        if record.status == "rejected":
            causes.append(f"plugin {record.name!r} ({record.distribution}) rejected: {record.reason}")
            _warn_passed_over(runtime, record.name, f"plugin rejected: {record.reason}")
    disabled = [record for record in discovery.plugins if record.status == "disabled"]
    for record in disabled:
        causes.append(f"plugin {record.name!r} ({record.distribution}) is disabled by HAL_DISABLE_PLUGINS")
    reason = "no installed backend is available"
    if causes:
        reason += " (" + "; ".join(causes) + ")"
    raise BackendUnavailableError("auto", reason, _nothing_available_remedy(disabled))


#: The distribution of the host backend every installation is meant to have.
FALLBACK_DISTRIBUTION = "hal-cpu"


def _nothing_available_remedy(disabled: list[PluginRecord]) -> str:
    """What to do when automatic selection finds nothing: re-enable what was disabled, install the fallback."""
    steps = []
    if disabled:
        names = ", ".join(repr(record.name) for record in disabled)
        steps.append(f"re-enable {names} by removing {'it' if len(disabled) == 1 else 'them'} from "
                     f"HAL_DISABLE_PLUGINS (now {_disabled_setting()!r}) or unsetting it")
    if not any(_normalise(record.distribution) == FALLBACK_DISTRIBUTION for record in disabled):
        steps.append(f"install (or repair) the CPU fallback with `pip install {FALLBACK_DISTRIBUTION}`")
    return "; or ".join(steps) + "; `hal info` shows every backend and plugin"


def _disabled_setting() -> str:
    return ",".join(sorted(_env.disabled_plugins()))


def _fresh(error: ConfigurationError) -> ConfigurationError:
    """A new instance of ``error`` to raise again (the stored one, with its traceback, becomes its cause)."""
    try:
        return copy.copy(error)
    except Exception:  # pragma: no cover - a subclass that cannot be rebuilt from its arguments
        return error


def _warn_passed_over(runtime: Runtime, name: str, reason: str) -> None:
    if name in runtime.warned:
        return
    runtime.warned.add(name)
    warnings.warn(f"hal: passing over backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)


def _get_named(runtime: Runtime, name: str) -> Backend:
    discovery = runtime.discovery()
    entries = [e for e in discovery.backends if e.name == name]
    if not entries:
        _raise_not_offered(discovery, name)
    entry = next((e for e in entries if not e.shadowed), None)
    if entry is None:
        raise BackendConflictError(entries[0].shadowed)
    availability = runtime.availability(entry)
    if not availability.ok:
        raise BackendUnavailableError(name, availability.reason, availability.remedy)
    return runtime.bind(entry)


def _raise_not_offered(discovery: Discovery, name: str) -> None:
    """Raise why no loaded plugin offers backend ``name``: a setting, a disabled or rejected plugin, or none."""
    rejected = [p for p in discovery.plugins if p.status != "loaded" and (p.name == name or name in p.backends)]
    if not rejected:
        raise BackendNotFoundError(name, sorted({e.name for e in discovery.backends}))
    record = rejected[0]
    error = discovery.setting_errors.get(record.name)
    if error is not None:
        raise _fresh(error) from error
    if record.status == "disabled":
        raise BackendUnavailableError(
            name, f"its plugin {record.name!r} ({record.distribution}) is disabled by HAL_DISABLE_PLUGINS",
            f"remove {record.name!r} from HAL_DISABLE_PLUGINS (now {_disabled_setting()!r}) "
            f"or unset it, then call hal_core.reset() if this process has looked for plugins already")
    raise BackendUnavailableError(name, f"its plugin was {record.status}: {record.reason}",
                                  "fix or reinstall the plugin; `hal info` shows every entry point")


def _reported_availability(runtime: Runtime, entry: BackendEntry) -> Availability:
    """``entry``'s availability for a report: a configuration error becomes its reason instead of raising."""
    try:
        return runtime.availability(entry)
    except ConfigurationError as exc:
        return Availability(False, f"configuration error: {exc}", "fix the setting it names, or unset it")


def list_backends() -> list[BackendInfo]:
    """Every backend offered by a loaded plugin: name, distribution, version, priority, state."""
    runtime = current()
    entries = sorted(runtime.discovery().backends, key=lambda e: (-e.priority, e.name))
    for entry in entries:
        if not entry.shadowed:
            runtime.start_probe(entry)
    try:
        fallback = runtime.fallback_entry()
    except ConfigurationError:  # the host backend's probe refused a setting: shown as its reason below
        fallback = None
    infos = []
    for entry in entries:
        if entry.shadowed:
            infos.append(BackendInfo(entry.name, entry.distribution, entry.version, entry.priority,
                                     entry.plugin, loaded=False, available=False, reason=entry.shadowed,
                                     selectable=False))
            continue
        availability = _reported_availability(runtime, entry)
        infos.append(BackendInfo(entry.name, entry.distribution, entry.version, entry.priority, entry.plugin,
                                 loaded=runtime.is_bound(entry), available=availability.ok,
                                 reason=availability.reason, remedy=availability.remedy,
                                 fallback=entry is fallback))
    return infos


def check_errors() -> None:
    """Raise the index errors device kernels recorded since the last check, as ``ArgumentError``.

    An op on device arrays never reads them back, so a bad block-table
    entry, length or slot is found by the kernel: it is never dereferenced
    (the output rows it affects are zeros, a bad slot's token is not
    written) and the argument is recorded on the device. This waits for the
    work queued on every device of the backends bound so far, then raises
    :class:`~hal_core.ArgumentError` naming the argument (``block_tables``,
    ``seq_lens``, ``slot_mapping``), once per recorded error. hal's own
    ``Stream.synchronize``, ``Event.synchronize`` and
    ``DeviceHandle.synchronize`` of a device backend check the same way.
    A no-op for host backends (they raise before any work) and when no
    backend is bound. Not to be called during a graph capture (it waits).
    """
    for backend in current().bound():
        backend.check_errors()


def stats() -> dict[str, dict[str, Any]]:
    """What the ops front doors did in this process, per bound backend and op.

    For each op: ``calls``, ``implementations`` (name → calls it answered;
    ``fallback:NAME`` or ``reference`` for the fallback path), ``fallbacks``
    (reason → calls) and ``fallback_seconds``. Backends that ran no op are
    left out; :func:`hal_core.reset` starts the counts afresh.
    """
    report = {}
    for backend in current().bound():
        per_op = backend.ops.stats()
        if per_op:
            report[backend.name] = per_op
    return report
