"""Choosing a backend: by name, by ``HAL_BACKEND``, or the best available."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from . import _env
from ._backend import Backend
from ._errors import BackendConflictError, BackendNotFoundError, BackendUnavailableError
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
    host backend (hal-cpu) is installed; it warns once when it passes over
    an installed backend that failed, and its error names every cause.
    """
    explicit = name or _env.backend_override()
    runtime = current()
    if explicit:
        return _get_named(runtime, explicit)
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
    discovery = runtime.discovery()
    for entry in discovery.backends:
        if entry.shadowed:
            causes.append(f"{entry.name} ({entry.distribution}): {entry.shadowed}")
    for record in discovery.plugins:
        if record.status == "rejected":
            causes.append(f"plugin {record.name!r} ({record.distribution}) rejected: {record.reason}")
            _warn_passed_over(runtime, record.name, f"plugin rejected: {record.reason}")
    remedy = ("install (or repair) the CPU fallback with `pip install hal-cpu`; "
              "`hal info` shows every backend and plugin")
    reason = "no installed backend is available"
    if causes:
        reason += " (" + "; ".join(causes) + ")"
    raise BackendUnavailableError("auto", reason, remedy)


def _warn_passed_over(runtime: Runtime, name: str, reason: str) -> None:
    if name in runtime.warned:
        return
    runtime.warned.add(name)
    warnings.warn(f"hal: passing over backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)


def _get_named(runtime: Runtime, name: str) -> Backend:
    discovery = runtime.discovery()
    entries = [e for e in discovery.backends if e.name == name]
    if not entries:
        rejected = [p for p in discovery.plugins if p.status != "loaded" and (p.name == name or name in p.backends)]
        if rejected:
            raise BackendUnavailableError(name, f"its plugin was {rejected[0].status}: {rejected[0].reason}",
                                          "fix or reinstall the plugin; `hal info` shows every entry point")
        raise BackendNotFoundError(name, sorted({e.name for e in discovery.backends}))
    entry = next((e for e in entries if not e.shadowed), None)
    if entry is None:
        raise BackendConflictError(entries[0].shadowed)
    availability = runtime.availability(entry)
    if not availability.ok:
        raise BackendUnavailableError(name, availability.reason, availability.remedy)
    return runtime.bind(entry)


def list_backends() -> list[BackendInfo]:
    """Every backend offered by a loaded plugin: name, distribution, version, priority, state."""
    runtime = current()
    entries = sorted(runtime.discovery().backends, key=lambda e: (-e.priority, e.name))
    for entry in entries:
        if not entry.shadowed:
            runtime.start_probe(entry)
    fallback = runtime.fallback_entry()
    infos = []
    for entry in entries:
        if entry.shadowed:
            infos.append(BackendInfo(entry.name, entry.distribution, entry.version, entry.priority,
                                     entry.plugin, loaded=False, available=False, reason=entry.shadowed,
                                     selectable=False))
            continue
        availability = runtime.availability(entry)
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
