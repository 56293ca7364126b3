"""The hot path: which implementation and which knob values a call gets, from the loaded tune table.

Tables are read from the store once per (backend object, device) and kept
in memory; :func:`forget` drops them (``hal tune`` does after writing).
Where the store holds no file of the backend, the device key (and so the
device's capabilities) is not even built.
``HAL_TUNE=0`` ignores the store (built-in rules only), read when a table
is first loaded. With no table, :func:`ordered` costs two dictionary
look-ups.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._store import TuneTable, device_key, has_tables, load_table, table_path, tune_dir

if TYPE_CHECKING:
    from ..ops import OpCall, OpImpl
    from ._knobs import Knob

__all__ = ["clear", "forget", "knob_choice", "knob_value", "ordered", "overridden", "override", "setting_value",
           "table_for"]

_MISSING = object()
#: id(backend) -> (a reference to the backend, {device index: table}); by id, since a backend need not be hashable.
_tables: dict[int, tuple[Callable[[], Any], dict[int, TuneTable | None]]] = {}
_lock = threading.Lock()
_overrides: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("hal_tune_overrides",
                                                                                    default=None)


def enabled() -> bool:
    """False when ``HAL_TUNE`` is off (read through the shared parser: an unknown spelling is an error)."""
    from .. import env

    return env.flag("HAL_TUNE", True)


def key_for(backend: Any, device_index: int = 0) -> dict[str, Any]:
    """The store key of ``backend``'s device ``device_index``."""
    from .._version import __version__

    return device_key(backend.name, backend.device(device_index).capabilities, __version__)


def table_for(backend: Any, device_index: int = 0) -> TuneTable | None:
    """The tune table that applies to ``backend``'s device (loaded once, then from memory)."""
    entry = _tables.get(id(backend))
    if entry is not None and entry[0]() is backend:
        found = entry[1].get(device_index, _MISSING)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
    with _lock:
        # the key needs the device's capabilities (for some backends a driver query): built only when the
        # store holds a file of this backend at all
        table = load_table(key_for(backend, device_index)) if enabled() and has_tables(backend.name) else None
        if table is not None and table.is_empty():
            table = None
        entry = _tables.get(id(backend))
        if entry is None or entry[0]() is not backend:
            for stale in [k for k, (ref, _) in _tables.items() if ref() is None]:
                del _tables[stale]
            entry = (_reference(backend), {})
            _tables[id(backend)] = entry
        entry[1][device_index] = table
    return table


def _reference(backend: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(backend)
    except TypeError:  # a backend with __slots__ and no __weakref__: keep it alive instead
        return lambda: backend


def forget() -> None:
    """Drop every loaded table; the next call reads the store again."""
    with _lock:
        _tables.clear()


def ordered(call: OpCall, impls: Sequence[OpImpl]) -> Sequence[OpImpl]:
    """``impls`` with the persisted choice for ``call``'s bucket moved first (unchanged without one).

    The dispatcher still asks each implementation's ``supports`` in this
    order, so a tuned choice that does not support the call falls through
    to the built-in order.
    """
    if len(impls) < 2:
        return impls
    table = table_for(call.backend, call.device_index)
    if table is None:
        return impls
    per_bucket = table.choices.get(call.op)
    if not per_bucket:
        return impls
    name = per_bucket.get(call.spec.bucket(call.args))
    if name is None:
        return impls
    for index, impl in enumerate(impls):
        if impl.name == name:
            return [impl, *impls[:index], *impls[index + 1:]] if index else impls
    return impls


def knob_value(call: OpCall, knob: Knob) -> Hashable:
    """An override set by :func:`override`, else the persisted winner for the call's bucket, else the rule."""
    value = knob_choice(call, knob)
    return knob.rule(call) if value is None else value


def knob_choice(call: OpCall, knob: Knob) -> Hashable | None:
    """An override set by :func:`override`, else the persisted winner for the call's bucket; None where the rule
    decides."""
    forced = _overrides.get()
    if forced is not None and knob.name in forced:
        return forced[knob.name]
    table = table_for(call.backend, call.device_index)
    if table is not None:
        per_knob = table.knobs.get(call.op, {}).get(knob.name)
        if per_knob:
            value = per_knob.get(call.spec.bucket(call.args), _MISSING)
            if value is not _MISSING and value in knob.candidates:
                return value
    return None


def setting_value(backend: Any, device_index: int, op: str, name: str, bucket: str) -> Any:
    """What ``hal tune`` persisted for ``op``'s ``"auto"`` setting ``name`` in ``bucket`` on this device, or None.

    Settings (:attr:`~hal_core.ops.OpSpec.auto_settings`) share the store's ``knobs[op]`` table with
    the implementations' knobs: ``knobs[op][name][bucket]``.
    """
    table = table_for(backend, device_index)
    if table is None:
        return None
    return table.knobs.get(op, {}).get(name, {}).get(bucket)


def overridden() -> bool:
    """Whether an :func:`override` block is active in this context (a plan made outside one does not hold in it)."""
    return _overrides.get() is not None


@contextlib.contextmanager
def override(values: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, :meth:`Knob.value` returns ``values[name]`` for the knobs named (used by the tuner)."""
    token = _overrides.set({**(_overrides.get() or {}), **values})
    try:
        yield
    finally:
        _overrides.reset(token)


def source(backend: Any, op: str, device_index: int = 0) -> dict[str, Any]:
    """What decides ``op`` on this device: ``{"tuned": bool, "choices": n, "knobs": {name: n}}``."""
    table = table_for(backend, device_index)
    choices = len(table.choices.get(op, {})) if table else 0
    knobs = {name: len(values) for name, values in (table.knobs.get(op, {}) if table else {}).items()}
    return {"tuned": bool(choices or any(knobs.values())), "choices": choices, "knobs": knobs}


def clear(backend: Any | None = None) -> list[Path]:
    """Remove the store files of ``backend``'s devices (every hal tune file when None); return them."""
    removed = []
    if backend is None:
        targets = list(tune_dir().glob("*.json")) if tune_dir().is_dir() else []
    else:
        targets = [table_path(key_for(backend, d.index)) for d in backend.devices()]
    for path in targets:
        if path.exists():
            path.unlink()
            removed.append(path)
    forget()
    return removed
