"""hal-cuda: the CUDA backend of hal, on CuPy.

Engine code does not import this package; ``hal_core.get_backend()`` finds it
through the ``hal`` entry point. Importing it imports no CuPy and touches no
driver: availability is probed with ctypes (see ``hal_cuda._probe``).
"""

from __future__ import annotations

from hal_cupy._device import CudaDevice
from hal_cupy._warmup import precompile

from ._backend import CudaBackend
from ._probe import ProbeResult, probe
from ._version import __version__

__all__ = ["CudaBackend", "CudaDevice", "ProbeResult", "__version__", "precompile", "probe"]
