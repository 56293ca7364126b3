"""hal-cupy: the vendor-neutral GPU layer of hal, over CuPy.

Devices, streams, events, allocators, the kernel launcher, the op
implementations, the specialisation and launch rules, and the kernel sources
(package data under ``hal_cupy/kernels``). A vendor plugin (hal-cuda,
hal-rocm) implements :class:`GpuPlatform` (probe, capabilities, compiler
options, prelude, DLPack device types) and subclasses :class:`CupyBackend`.
Importing this package imports no CuPy.
"""

from __future__ import annotations

from ._backend import CupyBackend
from ._device import CupyDevice, query_capabilities
from ._kernel_sources import kernel_source
from ._launcher import CupyKernel, CupyLauncher
from ._memory import CupyAllocator
from ._platform import GpuPlatform
from ._properties import ddr_bandwidth_gbps, property_text
from ._specialization import Specialization
from ._stream import CupyEvent, CupyStream
from ._version import __version__
from ._warmup import precompile
from .ops import all_specializations

__all__ = [
    "CupyAllocator",
    "CupyBackend",
    "CupyDevice",
    "CupyEvent",
    "CupyKernel",
    "CupyLauncher",
    "CupyStream",
    "GpuPlatform",
    "Specialization",
    "__version__",
    "all_specializations",
    "ddr_bandwidth_gbps",
    "kernel_source",
    "precompile",
    "property_text",
    "query_capabilities",
]
