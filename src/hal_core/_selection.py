"""Choosing a backend: by name, by ``HAL_BACKEND``, or the best available."""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass

from . import _env
from ._backend import Availability, Backend
from ._discovery import BackendEntry, discover
from ._errors import BackendConflictError, BackendNotFoundError, BackendUnavailableError

__all__ = ["BackendInfo", "cpu_backend", "get_backend", "list_backends"]

log = logging.getLogger("hal")

_lock = threading.RLock()
_bound: dict[str, Backend] = {}
_availability: dict[str, Availability] = {}
_failed: dict[str, str] = {}
_warned: set[str] = set()


@dataclass(frozen=True)
class BackendInfo:
    """What ``list_backends()`` reports for one backend offered by a plugin."""

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


def forget_bound() -> None:
    """Drop bound backends and cached availability (called by ``reset``)."""
    with _lock:
        _bound.clear()
        _availability.clear()
        _failed.clear()
        _warned.clear()


def _winner(name: str) -> BackendEntry | None:
    for entry in discover().backends:
        if entry.name == name and not entry.shadowed:
            return entry
    return None


def _check(entry: BackendEntry) -> Availability:
    with _lock:
        if entry.name in _failed:
            return Availability(False, _failed[entry.name], "see `hal info` and the debug log for the traceback")
        cached = _availability.get(entry.name)
        if cached is None:
            try:
                result = entry.cls.availability()
                cached = Availability(*result) if not isinstance(result, Availability) else result
                cached = cached._replace(ok=bool(cached.ok))
            except Exception as exc:
                log.debug("hal: %s availability() raised", entry.name, exc_info=exc)
                cached = Availability(False, f"availability() raised {type(exc).__name__}: {exc}")
            _availability[entry.name] = cached
        return cached


def _bind(entry: BackendEntry) -> Backend:
    """Instantiate and fully bind a backend, or record why it failed and raise."""
    with _lock:
        backend = _bound.get(entry.name)
        if backend is not None:
            return backend
        try:
            backend = entry.cls()
            devices = list(backend.devices())
            if not devices:
                raise RuntimeError("devices() returned no device")
            for device in devices:
                _ = device.capabilities
            _ = backend.ops  # registers op implementations; any error refuses the whole backend
        except Exception as exc:
            reason = f"failed to initialise: {type(exc).__name__}: {exc}"
            _failed[entry.name] = reason
            log.debug("hal: %s failed to initialise", entry.name, exc_info=exc)
            raise BackendUnavailableError(entry.name, reason, "see `hal info` and the debug log") from exc
        _bound[entry.name] = backend
        return backend


def get_backend(name: str | None = None) -> Backend:
    """The backend to use: ``name``, else ``HAL_BACKEND``, else the best available one.

    An explicit choice that cannot run raises :class:`BackendNotFoundError`
    or :class:`BackendUnavailableError` (with reason and remedy). Automatic
    selection never raises while hal-cpu is installed; it warns once when it
    passes over an installed backend that failed.
    """
    explicit = name or _env.backend_override()
    if explicit:
        return _get_named(explicit)
    state = discover()
    candidates = sorted((e for e in state.backends if not e.shadowed), key=lambda e: -e.priority)
    for entry in candidates:
        availability = _check(entry)
        if not availability.ok:
            if entry.name in _failed:
                _warn_passed_over(entry.name, availability.reason)
            else:
                log.info("hal: skipping backend %r: %s", entry.name, availability.reason)
            continue
        try:
            return _bind(entry)
        except BackendUnavailableError as exc:
            _warn_passed_over(entry.name, exc.reason)
    for entry in state.backends:
        if entry.shadowed.startswith("conflict"):
            _warn_passed_over(entry.name, entry.shadowed)
    for record in state.plugins:
        if record.status == "rejected":
            _warn_passed_over(record.name, f"plugin rejected: {record.reason}")
    raise BackendUnavailableError(
        "auto", "no installed backend is available", "install the CPU fallback with `pip install hal-cpu`"
    )


def _warn_passed_over(name: str, reason: str) -> None:
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(f"hal: passing over backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)


def _get_named(name: str) -> Backend:
    state = discover()
    entries = [e for e in state.backends if e.name == name]
    if not entries:
        rejected = [p for p in state.plugins if p.status != "loaded" and p.name == name]
        if rejected:
            raise BackendUnavailableError(name, f"its plugin was {rejected[0].status}: {rejected[0].reason}",
                                          "fix or reinstall the plugin; `hal info` shows every entry point")
        raise BackendNotFoundError(name, sorted({e.name for e in state.backends}))
    entry = _winner(name)
    if entry is None:
        raise BackendConflictError(entries[0].shadowed)
    availability = _check(entry)
    if not availability.ok:
        raise BackendUnavailableError(name, availability.reason, availability.remedy)
    return _bind(entry)


def cpu_backend() -> Backend | None:
    """The bound CPU backend (the fallback path), or None when hal-cpu is not usable."""
    try:
        return _get_named("cpu")
    except (BackendNotFoundError, BackendUnavailableError, BackendConflictError):
        return None


def list_backends() -> list[BackendInfo]:
    """Every backend offered by a loaded plugin: name, distribution, version, priority, state."""
    infos = []
    for entry in sorted(discover().backends, key=lambda e: (-e.priority, e.name)):
        if entry.shadowed:
            infos.append(BackendInfo(entry.name, entry.distribution, entry.version, entry.priority,
                                     entry.plugin, loaded=False, available=False, reason=entry.shadowed,
                                     selectable=False))
            continue
        availability = _check(entry)
        infos.append(BackendInfo(entry.name, entry.distribution, entry.version, entry.priority, entry.plugin,
                                 loaded=entry.name in _bound, available=availability.ok,
                                 reason=availability.reason, remedy=availability.remedy))
    return infos
