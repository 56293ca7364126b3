"""A device's feature flags (``DeviceCapabilities.features``), read once per backend object and device.

Settings chosen per call (:meth:`~hal_core.ops.OpSpec.settle`) depend on what the device offers, but
reading a device's capabilities can cost a driver query or a read of ``/proc``: the flags do not change
while the process runs, so they are read here on first use and then answered from memory.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["device_features", "forget_device_features"]

_log = logging.getLogger("hal_core.ops")

#: id(backend) -> (a reference to the backend, {device index: flags}); by id, since a backend need not be hashable.
_features: dict[int, tuple[Callable[[], Any], dict[int, frozenset[str]]]] = {}
_lock = threading.Lock()


def _reference(backend: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(backend)
    except TypeError:  # not weak-referenceable: keep it alive instead
        return lambda: backend


def device_features(backend: Any, device_index: int = 0) -> frozenset[str]:
    """The feature flags of ``backend``'s device ``device_index``; none when its capabilities cannot be read (logged
    once per device; every rule that reads a flag must then choose what is correct without it)."""
    entry = _features.get(id(backend))
    if entry is not None and entry[0]() is backend:
        found = entry[1].get(device_index)
        if found is not None:
            return found
    try:
        flags = frozenset(backend.device(device_index).capabilities.features)
    except Exception as exc:  # a plugin bug must not cost the caller the call
        _log.warning("hal: the capabilities of %s device %d could not be read (%s: %s); choosing as for a device "
                     "without feature flags", getattr(backend, "name", backend), device_index, type(exc).__name__, exc)
        flags = frozenset()
    with _lock:
        entry = _features.get(id(backend))
        if entry is None or entry[0]() is not backend:
            for stale in [key for key, (ref, _) in _features.items() if ref() is None]:
                del _features[stale]
            entry = (_reference(backend), {})
            _features[id(backend)] = entry
        entry[1][device_index] = flags
    return flags


def forget_device_features() -> None:
    """Drop every remembered flag set (tests that change what a device reports)."""
    with _lock:
        _features.clear()
