"""hal-cuda: the CUDA backend of hal, on the shared CuPy layer (hal-cupy).

Engine code does not import this package; ``hal_core.get_backend()`` finds it
through the ``hal`` entry point. Importing it imports no CuPy and touches no
driver: availability is probed with ctypes (see ``hal_cuda._probe``). What is
CUDA's own is :class:`CudaPlatform`; everything else lives in hal-cupy.
"""

from __future__ import annotations

from collections.abc import Sequence

from hal_cupy import Specialization
from hal_cupy import precompile as _precompile

from ._backend import CudaBackend, CudaDevice
from ._platform import CUDA, CudaPlatform
from ._probe import ProbeResult, probe
from ._version import __version__


def precompile(specs: Sequence[Specialization] | None = None, *, processes: int | None = None,
               device_index: int = 0, fmad: bool | None = None) -> tuple[int, float]:
    """Fill CuPy's kernel cache for the CUDA platform (see :func:`hal_cupy.precompile`)."""
    return _precompile(CUDA, specs, processes=processes, device_index=device_index, fmad=fmad)


__all__ = ["CUDA", "CudaBackend", "CudaDevice", "CudaPlatform", "ProbeResult", "__version__", "precompile", "probe"]
