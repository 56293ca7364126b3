"""hal-cpu: the CPU backend of hal, and the fallback every other backend relies on.

Engine code does not import this package; ``hal_core.get_backend()`` finds it
through the ``hal`` entry-point group. :func:`set_threads` (or
``HAL_CPU_THREADS``) bounds the threads its compiled kernels use. The classes are public for tests and
for backend authors who want a working example of every contract.
"""

from __future__ import annotations

from ._backend import CpuBackend
from ._device import CpuDevice, host_capabilities
from ._launcher import BlockContext, CpuKernel, CpuLauncher
from ._memory import CpuAllocator, CpuBuffer
from ._pool import host_runtime, pool_stats
from ._stream import CpuEvent, CpuStream
from ._threads import set_threads
from ._version import __version__

__all__ = [
    "BlockContext",
    "CpuAllocator",
    "CpuBackend",
    "CpuBuffer",
    "CpuDevice",
    "CpuEvent",
    "CpuKernel",
    "CpuLauncher",
    "CpuStream",
    "__version__",
    "host_capabilities",
    "host_runtime",
    "pool_stats",
    "set_threads",
]
