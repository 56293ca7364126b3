"""hal-cupy: the vendor-neutral GPU layer of hal, over CuPy.

Devices, streams, events, allocators, the kernel launcher, the op
implementations, the specialisation and launch rules, and the kernel sources
(package data under ``hal_cupy/kernels``). A vendor plugin (hal-cuda,
hal-rocm) supplies what differs per platform. Importing this package imports
no CuPy.
"""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]
