"""How many threads hal-cpu's compiled kernels may use: ``HAL_CPU_THREADS`` and :func:`set_threads`.

The default is every core this process may run on (``sched_getaffinity``).
``HAL_CPU_THREADS=N`` lowers it for the process (read once, on the first op);
:func:`set_threads` changes it at run time, for example when an engine runs
several workers on one machine, and ``set_threads(None)`` returns to the
default. A count above the cores is clamped to them (the pool has one worker
per core besides the caller: more threads would only take turns), with one
warning. Small ops run on one thread whatever the setting
(:func:`hal_cpu.ops._rules.threads_for`).

On a machine shared with other processes the pool backs off by itself: a job
in which a worker lost its core makes the next jobs run on the calling thread
alone (csrc/dispatch.cpp, Thread pool); :func:`pool_stats` counts both.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from hal_core import env

__all__ = ["THREADS_ENV", "available", "current", "pool_stats", "set_threads"]

_log = logging.getLogger("hal")

#: Environment variable: the default thread count of the compiled kernels (1 to the cores available).
THREADS_ENV = "HAL_CPU_THREADS"

_lock = threading.Lock()
_chosen: int | None = None  # the effective count, once resolved
_warned = False


def available() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        return max(1, os.cpu_count() or 1)


def _clamp(count: int, source: str) -> int:
    global _warned
    cores = available()
    if count > cores:
        if not _warned:
            _warned = True
            _log.warning("hal-cpu: %s asks for %d threads but this process runs on %d cores; using %d",
                         source, count, cores, cores)
        return cores
    return count


def current() -> int:
    """The thread count the kernels use now (:func:`set_threads`, else ``HAL_CPU_THREADS``, else every core)."""
    global _chosen
    chosen = _chosen
    if chosen is None:
        with _lock:
            if _chosen is None:
                wanted = env.integer(THREADS_ENV, 0, minimum=0, maximum=65536)
                _chosen = _clamp(wanted, THREADS_ENV) if wanted else available()
            chosen = _chosen
    return chosen


def set_threads(count: int | None) -> int:
    """Use at most ``count`` threads in every later op of this process; returns the previous count.

    ``None`` returns to the default (``HAL_CPU_THREADS``, else every core). Raises ``ValueError``
    for a count below 1. Calls already running keep the count they started with.
    """
    global _chosen
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"hal-cpu: set_threads(count) needs an integer >= 1 or None, got {count!r}")
    previous = current()
    with _lock:
        _chosen = None if count is None else _clamp(count, "set_threads")
    return previous


def pool_stats() -> dict[str, int]:
    """The kernels' thread pool since it was made: ``starved_jobs`` (a worker lost its core to another
    process while it ran its tasks) and ``serial_jobs`` (jobs then run on the calling thread alone).

    Both are 0 when the compiled kernels are not loaded or never ran a job on more than one thread.
    """
    from . import _native

    native = _native.try_load()
    if native is None:
        return {"starved_jobs": 0, "serial_jobs": 0}
    starved, serial = ctypes.c_int64(0), ctypes.c_int64(0)
    native.lib.hal_cpu_pool_stats(ctypes.byref(starved), ctypes.byref(serial))
    return {"starved_jobs": int(starved.value), "serial_jobs": int(serial.value)}
