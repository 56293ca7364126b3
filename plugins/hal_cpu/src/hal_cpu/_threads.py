"""How many threads hal-cpu's compiled kernels may use: ``HAL_CPU_THREADS`` and :func:`set_threads`.

The default is every core this process may run on (``sched_getaffinity``).
``HAL_CPU_THREADS=N`` (an integer from 1; unset or empty means the default)
lowers it for the process, read on the first op; any other value (``0``,
``-1``, ``1.5``, ``abc``) raises ``EnvironmentVariableError`` naming the
variable, at that op and at every later one until it is fixed (nothing is
cached from a bad value). :func:`set_threads` changes it at run time, for
example when an engine runs several workers on one machine, and
``set_threads(None)`` returns to the default. A count above the cores is
clamped to them (the pool has one worker per core besides the caller: more
threads would only take turns), with one warning per process. Small ops run
on one thread whatever the setting (:func:`hal_cpu.ops._rules.threads_for`).

Which pool runs the threads, and its back-off on a shared machine:
:mod:`hal_cpu._pool`.
"""

from __future__ import annotations

import logging
import os
import threading

from hal_core import env

__all__ = ["THREADS_ENV", "available", "current", "set_threads"]

_log = logging.getLogger("hal")

#: Environment variable: the default thread count of the compiled kernels (from 1; above the cores: clamped).
THREADS_ENV = "HAL_CPU_THREADS"

_lock = threading.Lock()
_chosen: int | None = None  # the effective count, once resolved
_warned = False
_MAX_THREADS = 65536


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
    """The thread count the kernels use now (:func:`set_threads`, else ``HAL_CPU_THREADS``, else every core).

    Raises ``EnvironmentVariableError`` naming ``HAL_CPU_THREADS`` when it holds anything but an integer
    from 1; nothing is cached then, so every later call checks the variable again.
    """
    global _chosen
    chosen = _chosen
    if chosen is None:
        with _lock:
            if _chosen is None:
                wanted = env.integer(THREADS_ENV, 0, minimum=1, maximum=_MAX_THREADS)  # 0: unset
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
