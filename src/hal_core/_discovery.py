"""Fault-isolated plugin discovery over the ``hal`` entry-point group.

pluggy's ``load_setuptools_entrypoints`` stops at the first plugin that
fails to import. Here each entry point is loaded on its own, checked in
full, and either bound whole or rejected with its reason; one broken
plugin never stops the others. Discovery runs lazily, once, under a lock;
:func:`reset` forgets everything (for tests).
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from . import _env, _hookspecs
from ._backend import Backend
from ._version import API_VERSION

__all__ = ["BackendEntry", "PluginRecord", "discover", "extra_op_impls", "reset"]

log = logging.getLogger("hal")


@dataclass
class PluginRecord:
    """One entry point of the ``hal`` group and what became of it."""

    name: str
    value: str
    distribution: str
    version: str
    status: str  # "loaded", "rejected" or "disabled"
    reason: str = ""
    backends: list[str] = field(default_factory=list)


@dataclass
class BackendEntry:
    """One backend class offered by a loaded plugin."""

    name: str
    cls: type[Backend]
    priority: int
    plugin: str
    distribution: str
    version: str
    #: Why this entry is not selectable although its plugin loaded (shadowed, conflict); empty if fine.
    shadowed: str = ""


@dataclass
class _State:
    manager: pluggy.PluginManager
    plugins: list[PluginRecord]
    backends: list[BackendEntry]


_lock = threading.RLock()
_state: _State | None = None


def discover() -> _State:
    """The discovery result, computed on first use."""
    global _state
    with _lock:
        if _state is None:
            _state = _discover()
        return _state


def reset() -> None:
    """Forget discovered plugins and bound backends (tests; after installing a plugin)."""
    global _state
    from . import _selection
    from .ops import _dispatch

    with _lock:
        _state = None
    # Outside the discovery lock: binding takes the selection lock, then this one.
    _selection.forget_bound()
    _dispatch.forget_logged_fallbacks()


def _compatible(version: Any) -> str:
    """Empty when ``version`` binds with this hal-core, else the reason it does not."""
    if (not isinstance(version, tuple) or len(version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)):
        return f"declares HAL API version {version!r}, which is not a (major, minor) tuple of ints"
    major, minor = version
    if major != API_VERSION[0] or minor > API_VERSION[1]:
        return (f"implements HAL API {major}.{minor} but hal-core {'.'.join(map(str, API_VERSION))} "
                f"supports {API_VERSION[0]}.0 to {API_VERSION[0]}.{API_VERSION[1]}; "
                f"install a matching version of the plugin or of hal-core")
    return ""


def _own_impl(hook: Any, plugin: object) -> Any:
    for impl in hook.get_hookimpls():
        if impl.plugin is plugin:
            return impl.function
    return None


def _check_backend_class(cls: Any) -> str:
    """Empty when ``cls`` is a complete Backend subclass, else why not."""
    if not (inspect.isclass(cls) and issubclass(cls, Backend)):
        return f"hal_backends returned {cls!r}, which is not a hal_core.Backend subclass"
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        return f"backend class {cls.__qualname__} leaves abstract methods unimplemented: {', '.join(missing)}"
    name, priority = getattr(cls, "name", None), getattr(cls, "priority", None)
    if not isinstance(name, str) or not name:
        return f"backend class {cls.__qualname__} sets no 'name' string"
    if not isinstance(priority, int) or isinstance(priority, bool):
        return f"backend class {cls.__qualname__} sets no integer 'priority'"
    version = getattr(cls, "api_version", None)
    problem = _compatible(version) if version is not None else ""
    return f"backend {name!r} {problem}" if problem else ""


def _load_plugin(manager: pluggy.PluginManager, ep: metadata.EntryPoint) -> tuple[PluginRecord, list[BackendEntry]]:
    dist = getattr(ep, "dist", None)
    record = PluginRecord(
        name=ep.name, value=ep.value,
        distribution=dist.metadata["Name"] if dist is not None else "?",
        version=dist.version if dist is not None else "?",
        status="rejected",
    )

    def reject(reason: str, exc: BaseException | None = None) -> tuple[PluginRecord, list[BackendEntry]]:
        record.reason = reason
        log.info("hal: plugin %r rejected: %s", ep.name, reason)
        if exc is not None:
            log.debug("hal: plugin %r traceback", ep.name, exc_info=exc)
        return record, []

    if ep.name in _env.disabled_plugins():
        record.status, record.reason = "disabled", "disabled by HAL_DISABLE_PLUGINS"
        return record, []
    try:
        module = ep.load()
    except Exception as exc:
        return reject(f"importing {ep.value!r} failed: {type(exc).__name__}: {exc}", exc)
    try:
        manager.register(module, name=f"hal-plugin:{ep.name}")
    except Exception as exc:
        return reject(f"invalid hook implementations: {type(exc).__name__}: {exc}", exc)

    def unregister_and_reject(reason: str, exc: BaseException | None = None):
        manager.unregister(module)
        return reject(reason, exc)

    version_hook = _own_impl(manager.hook.hal_api_version, module)
    if version_hook is None:
        return unregister_and_reject("declares no hal_api_version hook")
    try:
        version = version_hook()
    except Exception as exc:
        return unregister_and_reject(f"hal_api_version raised {type(exc).__name__}: {exc}", exc)
    problem = _compatible(version)
    if problem:
        warnings.warn(f"hal: plugin {ep.name!r} {problem}", RuntimeWarning, stacklevel=2)
        return unregister_and_reject(problem)
    backends_hook = _own_impl(manager.hook.hal_backends, module)
    try:
        classes = list(backends_hook()) if backends_hook is not None else []
    except Exception as exc:
        return unregister_and_reject(f"hal_backends raised {type(exc).__name__}: {exc}", exc)
    for cls in classes:
        problem = _check_backend_class(cls)
        if problem:
            return unregister_and_reject(problem)
    record.status = "loaded"
    record.backends = [cls.name for cls in classes]
    entries = [
        BackendEntry(name=cls.name, cls=cls, priority=cls.priority, plugin=ep.name,
                     distribution=record.distribution, version=record.version)
        for cls in classes
    ]
    return record, entries


def _resolve_names(entries: list[BackendEntry]) -> None:
    """Mark entries that lose a name to a higher priority, or tie for it."""
    by_name: dict[str, list[BackendEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    for name, group in by_name.items():
        group.sort(key=lambda e: -e.priority)
        best = group[0]
        ties = [e for e in group if e.priority == best.priority]
        if len(ties) > 1:
            who = " and ".join(f"{e.plugin!r} ({e.distribution})" for e in ties)
            for entry in ties:
                entry.shadowed = (f"conflict: plugins {who} both offer backend {name!r} at priority "
                                  f"{best.priority}; uninstall one or disable it with HAL_DISABLE_PLUGINS")
        for entry in group[len(ties):]:
            entry.shadowed = (f"shadowed by plugin {best.plugin!r} ({best.distribution}), which offers "
                              f"{name!r} at higher priority {best.priority}")


def _discover() -> _State:
    manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
    manager.add_hookspecs(_hookspecs)
    plugins: list[PluginRecord] = []
    backends: list[BackendEntry] = []
    seen: set[tuple[str, str]] = set()
    for ep in sorted(metadata.entry_points(group=_hookspecs.PROJECT_NAME), key=lambda e: e.name):
        if (ep.name, ep.value) in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add((ep.name, ep.value))
        clash = next((p for p in plugins if p.name == ep.name and p.status == "loaded"), None)
        if clash is not None:
            dist = getattr(ep, "dist", None)
            plugins.append(PluginRecord(
                name=ep.name, value=ep.value, distribution=dist.metadata["Name"] if dist else "?",
                version=dist.version if dist else "?", status="rejected",
                reason=(f"entry point name {ep.name!r} is already taken by {clash.value!r} "
                        f"({clash.distribution}); uninstall one, or disable it with HAL_DISABLE_PLUGINS"),
            ))
            continue
        record, entries = _load_plugin(manager, ep)
        plugins.append(record)
        backends.extend(entries)
    _resolve_names(backends)
    return _State(manager=manager, plugins=plugins, backends=backends)


def extra_op_impls(backend: Backend) -> list[Any]:
    """Op implementations that plugins add to ``backend`` through ``hal_extra_ops``."""
    from .ops import OPS, OpImpl

    state = discover()
    impls: list[Any] = []
    for hookimpl in state.manager.hook.hal_extra_ops.get_hookimpls():
        try:  # one plugin's extras never break another's backend
            returned: Any = hookimpl.function(backend=backend)  # plugin code: checked item by item below
            offered = list(returned or ())
            bad = [item for item in offered if not (isinstance(item, OpImpl) and item.op in OPS)]
            if bad:
                raise TypeError(f"expected OpImpl objects of known ops {sorted(OPS)}, got {bad[0]!r}")
        except Exception as exc:
            log.warning("hal: %s hal_extra_ops for backend %r failed (%s: %s); its extra ops are ignored",
                        hookimpl.plugin_name, backend.name, type(exc).__name__, exc)
            log.debug("hal: traceback", exc_info=exc)
            continue
        impls.extend(offered)
    return impls
