"""hal-rocm: the ROCm backend of hal, on the shared CuPy layer (hal-cupy).

Engine code does not import this package; ``hal_core.get_backend()`` finds it
through the ``hal`` entry point. Importing it imports no CuPy and loads no
HIP library: availability is probed with ctypes (see ``hal_rocm._probe``).
What is AMD's own is :class:`RocmPlatform`; everything else lives in hal-cupy.
"""

from __future__ import annotations

from ._backend import RocmBackend
from ._platform import ROCM, RocmPlatform
from ._probe import ProbeResult, probe
from ._version import __version__

__all__ = ["ROCM", "ProbeResult", "RocmBackend", "RocmPlatform", "__version__", "probe"]
