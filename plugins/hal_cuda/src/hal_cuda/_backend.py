"""The CUDA backend: every visible NVIDIA GPU through the shared CuPy layer.

Importing this module imports no CuPy; :meth:`CudaBackend.availability`
probes the driver with ctypes first (see :mod:`hal_cuda._probe`).
"""

from __future__ import annotations

from typing import ClassVar

from hal_cupy import CupyBackend, CupyDevice, GpuPlatform

from hal_core import AllocationPolicy

from ._platform import CUDA

__all__ = ["CudaBackend", "CudaDevice"]


class CudaDevice(CupyDevice):
    """A visible NVIDIA GPU (the shared CuPy device on the CUDA platform)."""

    def __init__(self, index: int, *, policy: AllocationPolicy | str | None = None) -> None:
        super().__init__(index, CUDA, policy=policy)


class CudaBackend(CupyBackend):
    """NVIDIA GPUs: CuPy memory pools and streams, NVRTC-compiled kernels."""

    name = "cuda"
    priority = 100
    platform: ClassVar[GpuPlatform] = CUDA

    def make_device(self, index: int) -> CudaDevice:
        return CudaDevice(index)
