"""The ROCm backend: every visible AMD GPU through the shared CuPy layer.

Importing this module imports no CuPy; :meth:`RocmBackend.availability`
probes the HIP runtime with ctypes first (see :mod:`hal_rocm._probe`).
"""

from __future__ import annotations

from typing import ClassVar

from hal_cupy import CupyBackend, GpuPlatform

from ._platform import ROCM

__all__ = ["RocmBackend"]


class RocmBackend(CupyBackend):
    """AMD GPUs: CuPy (ROCm build) memory pools and streams, HIPRTC-compiled kernels."""

    name = "rocm"
    #: Just below CUDA's 100: on a machine with both, CUDA is chosen unless HAL_BACKEND=rocm.
    priority = 90
    platform: ClassVar[GpuPlatform] = ROCM
