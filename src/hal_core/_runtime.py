"""The runtime state of one process: discovery, probes and bound backends, in one object.

:class:`Runtime` holds everything hal learns about the installed plugins:
the :class:`~hal_core._discovery.Discovery`, each backend's availability
probe and each bound backend. :func:`reset` replaces the object whole
(after calling every bound backend's :meth:`~hal_core.Backend.on_reset`),
so no module keeps state of its own that a reset could miss.

Locks guard only hal's own bookkeeping and binding. ``availability()``
runs outside every lock, once per backend, in a daemon thread that the
caller waits for at most ``HAL_PROBE_TIMEOUT_S`` seconds: a probe that
hangs makes its backend unavailable and delays nobody else.

Probes and binding run plugin code under :func:`hal_core._env_guard.watch`:
a plugin that changes a ``HAL_*`` variable there is rejected whole (its
backends leave the discovery, its record says why) and the user's value is
put back. A :class:`~hal_core.ConfigurationError` raised by a probe or by
binding reaches the caller instead of making the backend unavailable, and
nothing of it is remembered: once the setting is fixed, the next call
probes or binds again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from . import _env
from ._backend import Availability, Backend
from ._discovery import BackendEntry, Discovery, discover_plugins, extra_op_impls, guarded
from ._env_guard import describe, watch
from ._errors import BackendUnavailableError, ConfigurationError, configuration_error

__all__ = ["Runtime", "current", "reset"]

log = logging.getLogger("hal")


def validated_availability(result: Any) -> Availability:
    """``result`` of ``availability()`` as an :class:`Availability`, or a refusal saying what was wrong."""
    if isinstance(result, tuple) and 1 <= len(result) <= 3:
        ok, reason, remedy = (*result, "", "")[:3]
        if isinstance(ok, bool) and isinstance(reason, str) and isinstance(remedy, str):
            return Availability(ok, reason, remedy)
    return Availability(False, f"availability() returned {result!r}, not Availability(ok: bool, reason: str)",
                        "fix the plugin: availability() must return hal_core.Availability")


class _Probe:
    """One backend's ``availability()``, run once in a daemon thread."""

    def __init__(self, entry: BackendEntry) -> None:
        self._entry = entry
        self._done = threading.Event()
        self._result: Availability | None = None
        self._interrupt: BaseException | None = None
        #: Why the plugin is refused: its availability() changed a HAL_* variable (put back since); "" if not.
        self.tampered = ""
        #: The configuration error availability() raised, if any (for the caller to raise).
        self.setting: ConfigurationError | None = None
        threading.Thread(target=self._run, name=f"hal-probe-{entry.name}", daemon=True).start()

    def _run(self) -> None:
        try:
            with watch() as changes:
                result, exc = guarded(f"{self._entry.name} availability()", self._entry.cls.availability)
            self.setting = configuration_error(exc)
            if changes:
                self.tampered = describe(changes, "its availability()")
                self._result = Availability(False, self.tampered, _REFUSED)
            elif exc is not None:
                self._result = Availability(False, f"availability() raised {type(exc).__name__}: {exc}")
            else:
                self._result = validated_availability(result)
        except KeyboardInterrupt as exc:  # pragma: no cover - only raised by a plugin on purpose
            self._interrupt = exc
        finally:
            self._done.set()

    def wait(self, timeout: float) -> Availability:
        if not self._done.wait(timeout):
            self._result = Availability(
                False, f"probe timed out after {timeout:g} s",
                "the plugin's availability() hangs; fix or disable it (HAL_DISABLE_PLUGINS), "
                "or raise HAL_PROBE_TIMEOUT_S",
            )
            self._done.set()
        if self._interrupt is not None:
            raise self._interrupt
        assert self._result is not None
        return self._result


class Runtime:
    """Discovery, probes and bound backends of this process (replaced whole by :func:`reset`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # hal's bookkeeping only: never held while plugin code runs
        self._discovery_lock = threading.Lock()
        self._discovery: Discovery | None = None
        self._probes: dict[int, _Probe] = {}
        self._bind_locks: dict[int, threading.Lock] = {}
        self._bound: dict[int, Backend] = {}
        self.failed: dict[str, str] = {}
        self.warned: set[str] = set()

    # -- discovery --------------------------------------------------------

    def discovery(self) -> Discovery:
        """The discovery result, computed on first use (plugins are imported once)."""
        found = self._discovery
        if found is None:
            with self._discovery_lock:
                if self._discovery is None:
                    self._discovery = discover_plugins()
                found = self._discovery
        return found

    def selectable(self) -> list[BackendEntry]:
        """Backends that hold their name, highest priority first."""
        return sorted((e for e in self.discovery().backends if not e.shadowed), key=lambda e: (-e.priority, e.name))

    # -- availability -----------------------------------------------------

    def start_probe(self, entry: BackendEntry) -> _Probe:
        """Start ``entry``'s probe if it has not run yet (it then runs in the background)."""
        with self._lock:
            probe = self._probes.get(id(entry))
            if probe is None:
                probe = self._probes[id(entry)] = _Probe(entry)
        return probe

    def availability(self, entry: BackendEntry) -> Availability:
        """``entry``'s availability: probed once, waited for at most ``HAL_PROBE_TIMEOUT_S``.

        Raises the :class:`~hal_core.ConfigurationError` the probe raised (the probe then runs
        again at the next call); rejects the plugin whose probe changed a ``HAL_*`` variable.
        """
        failed = self.failed.get(entry.name)
        if failed is not None:
            return Availability(False, failed, "see `hal info` and the debug log for the traceback")
        timeout = _env.probe_timeout_s()
        probe = self.start_probe(entry)
        result = probe.wait(timeout)
        if probe.tampered:
            self.reject(entry.plugin, probe.tampered)
            return Availability(False, probe.tampered, _REFUSED)
        if probe.setting is not None:
            with self._lock:
                if self._probes.get(id(entry)) is probe:
                    del self._probes[id(entry)]
            raise probe.setting
        return result

    def reject(self, plugin: str, reason: str) -> None:
        """Reject the loaded plugin ``plugin`` whole, for ``reason`` (see :meth:`Discovery.reject`)."""
        with self._lock:
            self.discovery().reject(plugin, reason)

    # -- binding ----------------------------------------------------------

    def bound(self) -> list[Backend]:
        """Every backend bound so far."""
        with self._lock:
            return list(self._bound.values())

    def is_bound(self, entry: BackendEntry) -> bool:
        with self._lock:
            return id(entry) in self._bound

    def fallback_entry(self) -> BackendEntry | None:
        """The fallback backend: the available host backend with the lowest priority (hal-cpu)."""
        hosts = sorted((e for e in self.selectable() if e.cls.is_host), key=lambda e: (e.priority, e.name))
        for entry in hosts:
            self.start_probe(entry)
        for entry in hosts:
            if self.availability(entry).ok:
                return entry
        return None

    def bind(self, entry: BackendEntry) -> Backend:
        """Instantiate and fully bind ``entry``'s backend once, or record why it failed and raise.

        A :class:`~hal_core.ConfigurationError` is raised as it is and not recorded, so the
        next call binds again once the setting is fixed.
        """
        from .ops import Ops

        with self._lock:
            backend = self._bound.get(id(entry))
            if backend is not None:
                return backend
            bind_lock = self._bind_locks.setdefault(id(entry), threading.Lock())
        fallback_entry = self.fallback_entry()
        fallback = None
        if fallback_entry is not None and fallback_entry is not entry:
            try:
                fallback = self.bind(fallback_entry)
            except BackendUnavailableError:
                fallback = None
        with bind_lock:
            with self._lock:
                backend = self._bound.get(id(entry))
            if backend is not None:
                return backend

            def build() -> Backend:
                instance = entry.cls()
                devices = list(instance.devices())
                if not devices:
                    raise RuntimeError("devices() returned no device")
                extras = extra_op_impls(self.discovery(), entry, instance)
                Ops.attach(instance, fallback=fallback, extra_impls=extras)
                return instance

            with watch() as changes:
                backend, exc = guarded(f"binding backend {entry.name!r}", build)
            if changes:
                reason = describe(changes, f"binding its backend {entry.name!r}")
                if backend is not None:
                    guarded(f"{entry.name} on_reset()", backend.on_reset)
                self.failed[entry.name] = reason
                self.reject(entry.plugin, reason)
                raise BackendUnavailableError(entry.name, reason, _REFUSED)
            setting = configuration_error(exc)
            if setting is not None:
                raise setting
            rejected = self._rejection(entry.plugin)
            if exc is None and rejected:  # e.g. its hal_extra_ops, run while binding another backend
                if backend is not None:
                    guarded(f"{entry.name} on_reset()", backend.on_reset)
                self.failed[entry.name] = f"its plugin was rejected: {rejected}"
                raise BackendUnavailableError(entry.name, self.failed[entry.name], _REFUSED)
            if exc is not None:
                reason = f"failed to initialise: {type(exc).__name__}: {exc}"
                self.failed[entry.name] = reason
                raise BackendUnavailableError(entry.name, reason, "see `hal info` and the debug log") from exc
            with self._lock:
                self._bound[id(entry)] = backend
            if fallback is not None:
                log.info("hal: backend %r bound; its fallback is %r", entry.name, fallback.name)
            return backend

    def _rejection(self, plugin: str) -> str:
        """Why ``plugin`` was rejected after discovery (it then offers nothing), or "" while it is loaded."""
        if self.discovery().record(plugin) is not None:
            return ""
        return next((p.reason for p in self.discovery().plugins if p.name == plugin), "rejected")

    def close(self) -> None:
        """Call every bound backend's ``on_reset`` (errors are logged, never raised)."""
        for backend in self.bound():
            _, exc = guarded(f"{backend.name} on_reset()", backend.on_reset)
            if exc is not None:
                log.warning("hal: backend %r on_reset() raised %s: %s", backend.name, type(exc).__name__, exc)


#: The remedy of a plugin refused for changing a HAL_* variable.
_REFUSED = "fix the plugin so it leaves HAL_* variables alone, or disable it with HAL_DISABLE_PLUGINS"

_current = Runtime()
_current_lock = threading.Lock()


def current() -> Runtime:
    """The runtime in use."""
    return _current


def reset() -> None:
    """Forget discovered plugins and bound backends (tests; after installing a plugin).

    Every bound backend's :meth:`~hal_core.Backend.on_reset` runs first, so
    plugin caches do not outlive the instances they served.
    """
    global _current
    with _current_lock:
        old, _current = _current, Runtime()
    old.close()
