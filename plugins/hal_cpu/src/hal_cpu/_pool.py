"""Which pool runs the compiled kernels' parallel jobs: ``HAL_CPU_HOST_POOL`` and :func:`pool_stats`.

Every parallel region of the kernels runs on one of two pools
(csrc/dispatch.cpp, Parallel jobs): hal-cpu's own workers, or, once the
process has loaded an OpenMP runtime (torch's wheels bundle GNU libgomp), that
runtime's team, so that its threads, polling for their next region after each
torch op, take hal's tasks instead of competing with hal's workers for the
cores. The library looks for such a runtime itself, at each parallel job when
the count of loaded libraries changed: the first job after ``import torch``
moves. Nothing is loaded for it and no environment variable is changed.
``HAL_CPU_HOST_POOL=0`` keeps every job on the own pool (diagnosis); the
library reads it when it loads (:mod:`hal_cpu._native`).
"""

from __future__ import annotations

import ctypes

from . import _native
from ._native import HOST_POOL_ENV

__all__ = ["COUNTERS", "HOST_POOL_ENV", "host_runtime", "pool_stats"]

#: The keys of :func:`pool_stats`, in the order ``hal_cpu_pool_stats`` writes them.
COUNTERS = ("starved_jobs", "serial_jobs", "own_pool_jobs", "host_pool_jobs", "nested_jobs")


def pool_stats() -> dict[str, int]:
    """Counts of the kernels' parallel jobs since the library loaded.

    ``own_pool_jobs`` ran on hal-cpu's workers, ``host_pool_jobs`` on a loaded
    OpenMP runtime's team; ``starved_jobs``: a helper thread lost its core to
    another process while it ran its tasks; ``serial_jobs``: run on the calling
    thread alone in the back-off that follows; ``nested_jobs``: run on the
    calling thread alone because it was inside an OpenMP parallel region. All
    0 when the compiled kernels are not loaded or never ran a parallel job.
    """
    native = _native.try_load()
    if native is None:
        return dict.fromkeys(COUNTERS, 0)
    counts = (ctypes.c_int64 * len(COUNTERS))()
    native.lib.hal_cpu_pool_stats(counts, len(COUNTERS))
    return {name: int(value) for name, value in zip(COUNTERS, counts, strict=True)}


def host_runtime() -> str | None:
    """The path of the OpenMP runtime parallel jobs run on now, or None (hal-cpu's own pool).

    None without the compiled kernels, without a loaded OpenMP runtime, in a
    forked child, and with ``HAL_CPU_HOST_POOL=0``.
    """
    native = _native.try_load()
    if native is None:
        return None
    path = native.lib.hal_cpu_host_runtime()
    return None if path is None else path.decode()
