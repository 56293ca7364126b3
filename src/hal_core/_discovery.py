"""Fault-isolated plugin discovery over the ``hal`` entry-point group.

pluggy's ``load_setuptools_entrypoints`` stops at the first plugin that
fails to import. Here each entry point is loaded on its own, checked in
full, and either kept whole or rejected with its reason; one broken
plugin never stops the others, and nothing a plugin raises (``SystemExit``
included; only ``KeyboardInterrupt`` passes) ends the host program.

Plugin code may not change the user's ``HAL_*`` settings: a plugin whose
import or hooks set or unset one is refused with the variables named, and
the user's values are put back (:mod:`hal_core._env_guard`). A plugin whose
code raises a :class:`~hal_core.ConfigurationError` (it read a setting of
the user's and refused it) is rejected too, and :attr:`Discovery.setting_errors`
keeps the error for selection to raise.

A backend name belongs to one distribution: the one named
``hal-<backend name>`` when several offer it. Another distribution may
replace that backend, or add implementations to it through
``hal_extra_ops``, only when ``HAL_ALLOW_OVERRIDE`` names it; otherwise its
plugin is rejected (or its extras refused) with the reason.

This module holds no state: :func:`discover_plugins` returns a fresh
:class:`Discovery`, which the runtime (:mod:`hal_core._runtime`) keeps.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import _env, _hookspecs
from ._backend import Backend
from ._entry_points import FoundEntryPoint, entry_points
from ._env_guard import describe, watch
from ._errors import ConfigurationError, configuration_error
from ._version import API_VERSION

__all__ = ["BackendEntry", "Discovery", "PluginRecord", "discover_plugins", "extra_op_impls", "guarded",
           "owner_distribution"]

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
    #: Extra implementations of this plugin that hal refused, each with the reason.
    refused: list[str] = field(default_factory=list)


@dataclass
class BackendEntry:
    """One backend class offered by a loaded plugin."""

    name: str
    cls: type[Backend]
    priority: int
    plugin: str
    distribution: str
    version: str
    #: Why this entry is not selectable although its plugin loaded (shadowed, replaced); empty if fine.
    shadowed: str = ""


@dataclass
class Discovery:
    """What one discovery pass found: pluggy's manager, every entry point, every backend class."""

    manager: pluggy.PluginManager
    plugins: list[PluginRecord]
    backends: list[BackendEntry]
    #: Plugin name -> the configuration error its import or hooks raised (the plugin is rejected).
    setting_errors: dict[str, ConfigurationError] = field(default_factory=dict)

    def record(self, plugin_name: str) -> PluginRecord | None:
        """The record of the entry point registered with pluggy as ``plugin_name``."""
        name = plugin_name.removeprefix("hal-plugin:")
        return next((p for p in self.plugins if p.name == name and p.status == "loaded"), None)

    def reject(self, plugin: str, reason: str) -> None:
        """Reject the loaded plugin ``plugin`` after discovery: its record says why, its backends and hooks go."""
        record = self.record(plugin)
        if record is None:
            return
        record.status, record.reason = "rejected", reason
        self.backends = [e for e in self.backends if e.plugin != plugin]
        registered = self.manager.get_plugin(f"hal-plugin:{plugin}")
        if registered is not None:
            self.manager.unregister(registered)
        log.warning("hal: plugin %r rejected: %s", plugin, reason)


def guarded(what: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, BaseException | None]:
    """``fn(*args, **kwargs)`` with any exception but ``KeyboardInterrupt`` caught: (result, error)."""
    try:
        return fn(*args, **kwargs), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, ... from plugin code: never ours to obey
        log.debug("hal: %s raised", what, exc_info=exc)
        return None, exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
    if not isinstance(cls.is_host, bool):
        return f"backend class {cls.__qualname__} sets 'is_host' to {cls.is_host!r}, not a bool"
    codes = cls.dlpack_device_types
    if not isinstance(codes, frozenset) or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        return f"backend class {cls.__qualname__} sets 'dlpack_device_types' to {codes!r}, not a frozenset of ints"
    return ""


def _load_plugin(manager: pluggy.PluginManager, ep: FoundEntryPoint,
                 disabled: frozenset[str]) -> tuple[PluginRecord, list[BackendEntry], BaseException | None]:
    """Import and check one entry point: its record, its backends, and the error that rejected it (if any)."""
    record = PluginRecord(name=ep.name, value=ep.value, distribution=ep.distribution, version=ep.version,
                          status="rejected")
    if ep.name in disabled:
        record.status = "disabled"
        record.reason = (f"disabled by HAL_DISABLE_PLUGINS={','.join(sorted(disabled))!r}; to load it, remove "
                         f"{ep.name!r} from that list (or unset it)")
        return record, [], None
    with watch() as changes:
        classes, problem, exc = _import_and_check(manager, ep)
    if changes:
        tampered = describe(changes, "importing it or calling its hooks")
        problem = f"{problem}; and {tampered}" if problem else tampered
        registered = manager.get_plugin(f"hal-plugin:{ep.name}")
        if registered is not None:
            manager.unregister(registered)
    if problem:
        record.reason = problem
        log.log(logging.WARNING if changes else logging.INFO, "hal: plugin %r rejected: %s", ep.name, problem)
        if exc is not None:
            log.debug("hal: plugin %r traceback", ep.name, exc_info=exc)
        return record, [], exc
    record.status = "loaded"
    record.backends = [cls.name for cls in classes]
    entries = [
        BackendEntry(name=cls.name, cls=cls, priority=cls.priority, plugin=ep.name,
                     distribution=record.distribution, version=record.version)
        for cls in classes
    ]
    return record, entries, None


def _import_and_check(manager: pluggy.PluginManager,
                      ep: FoundEntryPoint) -> tuple[list[type[Backend]], str, BaseException | None]:
    """Import ``ep``, register it and call its hooks: (backend classes, "", None) or ([], why not, error)."""
    module, exc = guarded(f"importing plugin {ep.name!r}", ep.load)
    if exc is not None:
        return [], f"importing {ep.value!r} failed: {_describe(exc)}", exc
    _, exc = guarded(f"registering plugin {ep.name!r}", manager.register, module, name=f"hal-plugin:{ep.name}")
    if exc is not None:
        return [], f"invalid hook implementations: {_describe(exc)}", exc

    def refuse(reason: str, exc: BaseException | None = None) -> tuple[list[type[Backend]], str, BaseException | None]:
        manager.unregister(module)
        return [], reason, exc

    version_hook = _own_impl(manager.hook.hal_api_version, module)
    if version_hook is None:
        return refuse("declares no hal_api_version hook")
    version, exc = guarded(f"{ep.name} hal_api_version", version_hook)
    if exc is not None:
        return refuse(f"hal_api_version raised {_describe(exc)}", exc)
    problem = _compatible(version)
    if problem:
        warnings.warn(f"hal: plugin {ep.name!r} {problem}", RuntimeWarning, stacklevel=3)
        return refuse(problem)
    backends_hook = _own_impl(manager.hook.hal_backends, module)
    classes, exc = guarded(f"{ep.name} hal_backends", lambda: list(backends_hook()) if backends_hook else [])
    if exc is not None:
        return refuse(f"hal_backends raised {_describe(exc)}", exc)
    for cls in classes:
        problem = _check_backend_class(cls)
        if problem:
            return refuse(problem)
    return classes, "", None


def owner_distribution(backend_name: str) -> str:
    """The distribution that owns a backend name when several offer it: ``hal-<name>``."""
    return _normalise(f"hal-{backend_name}")


def _normalise(distribution: str) -> str:
    return distribution.lower().replace("_", "-").replace(".", "-")


def _resolve_ownership(manager: pluggy.PluginManager, plugins: list[PluginRecord],
                       entries: list[BackendEntry]) -> list[BackendEntry]:
    """Reject plugins that offer a backend name another distribution owns; return the entries left."""
    allowed = {_normalise(d) for d in _env.allowed_overrides()}
    by_name: dict[str, list[BackendEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    offenders: dict[str, str] = {}  # plugin name -> reason
    for name, group in by_name.items():
        dists = {_normalise(e.distribution) for e in group}
        if len(dists) < 2:
            continue
        owner = owner_distribution(name)
        listing = ", ".join(sorted(e.distribution for e in group))
        chosen = dists & allowed
        for entry in group:
            dist = _normalise(entry.distribution)
            if chosen:
                if dist not in chosen:
                    winners = ", ".join(sorted(chosen))
                    entry.shadowed = f"replaced by distribution {winners} (allowed by HAL_ALLOW_OVERRIDE)"
                continue
            if dist == owner:
                continue
            holder = f"distribution {owner!r}" if owner in dists else "another distribution"
            offenders.setdefault(entry.plugin, (
                f"offers backend {name!r}, which {holder} also offers ({listing}); a plugin may not replace "
                f"another distribution's backend: uninstall one, or allow this one with "
                f"HAL_ALLOW_OVERRIDE={entry.distribution}"
            ))
    for record in plugins:
        if record.status == "loaded" and record.name in offenders:
            record.status, record.reason = "rejected", offenders[record.name]
            log.warning("hal: plugin %r rejected: %s", record.name, record.reason)
            plugin = manager.get_plugin(f"hal-plugin:{record.name}")
            if plugin is not None:
                manager.unregister(plugin)
    return [e for e in entries if e.plugin not in offenders]


def _resolve_names(entries: list[BackendEntry]) -> None:
    """Within what is left, mark entries that lose a name to a higher priority, or tie for it."""
    by_name: dict[str, list[BackendEntry]] = {}
    for entry in entries:
        if not entry.shadowed:
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


def discover_plugins() -> Discovery:
    """Import and check every entry point of the ``hal`` group (``HAL_DISABLE_PLUGINS`` ones excepted).

    Raises :class:`~hal_core.EnvironmentVariableError` before importing anything when
    ``HAL_DISABLE_PLUGINS`` or ``HAL_ALLOW_OVERRIDE`` is not a comma-separated list of names.
    """
    disabled = _env.disabled_plugins()
    _env.allowed_overrides()
    manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
    manager.add_hookspecs(_hookspecs)
    plugins: list[PluginRecord] = []
    backends: list[BackendEntry] = []
    setting_errors: dict[str, ConfigurationError] = {}
    seen: set[tuple[str, str]] = set()
    for ep in sorted(entry_points(_hookspecs.PROJECT_NAME), key=lambda e: e.name):
        if (ep.name, ep.value) in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add((ep.name, ep.value))
        clash = next((p for p in plugins if p.name == ep.name and p.status == "loaded"), None)
        if clash is not None:
            plugins.append(PluginRecord(
                name=ep.name, value=ep.value, distribution=ep.distribution, version=ep.version, status="rejected",
                reason=(f"entry point name {ep.name!r} is already taken by {clash.value!r} "
                        f"({clash.distribution}); uninstall one, or disable it with HAL_DISABLE_PLUGINS"),
            ))
            continue
        record, entries, exc = _load_plugin(manager, ep, disabled)
        plugins.append(record)
        backends.extend(entries)
        setting = configuration_error(exc)
        if setting is not None:
            setting_errors[ep.name] = setting
    backends = _resolve_ownership(manager, plugins, backends)
    _resolve_names(backends)
    return Discovery(manager=manager, plugins=plugins, backends=backends, setting_errors=setting_errors)


def extra_op_impls(discovery: Discovery, entry: BackendEntry, backend: Backend) -> list[Any]:
    """Op implementations plugins add to ``backend`` through ``hal_extra_ops``, where they may.

    A plugin of another distribution than the backend's may add
    implementations only when ``HAL_ALLOW_OVERRIDE`` names its distribution;
    otherwise its offer is refused and recorded on its :class:`PluginRecord`.
    """
    from .ops import OPS, OpImpl

    allowed = {_normalise(d) for d in _env.allowed_overrides()}
    impls: list[Any] = []
    for hookimpl in discovery.manager.hook.hal_extra_ops.get_hookimpls():
        record = discovery.record(hookimpl.plugin_name)
        with watch() as changes:
            offered, exc = guarded(f"{hookimpl.plugin_name} hal_extra_ops",
                                   lambda f=hookimpl.function: list(f(backend=backend) or ()))
        if changes:
            discovery.reject(hookimpl.plugin_name.removeprefix("hal-plugin:"),
                             describe(changes, f"its hal_extra_ops hook (for backend {backend.name!r})"))
            continue
        setting = configuration_error(exc)
        if setting is not None:
            raise setting  # the user's setting is wrong: binding the backend without these ops would hide it
        if exc is None:
            bad = [item for item in offered if not (isinstance(item, OpImpl) and item.op in OPS)]
            if bad:
                exc = TypeError(f"expected OpImpl objects of known ops {sorted(OPS)}, got {bad[0]!r}")
        if exc is not None:
            log.warning("hal: %s hal_extra_ops for backend %r failed (%s); its extra ops are ignored",
                        hookimpl.plugin_name, backend.name, _describe(exc))
            continue
        if not offered:
            continue
        dist = record.distribution if record is not None else "?"
        if _normalise(dist) != _normalise(entry.distribution) and _normalise(dist) not in allowed:
            reason = (f"hal_extra_ops offered {len(offered)} implementation(s) for backend {backend.name!r} "
                      f"of distribution {entry.distribution!r}; refused: a plugin may not extend another "
                      f"distribution's backend unless HAL_ALLOW_OVERRIDE={dist} allows it")
            log.warning("hal: plugin %s: %s", hookimpl.plugin_name, reason)
            if record is not None and reason not in record.refused:
                record.refused.append(reason)
            continue
        impls.extend(offered)
    return impls
