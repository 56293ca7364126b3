"""The CUDA backend: every visible NVIDIA GPU through CuPy.

Importing this module imports no CuPy; :meth:`CudaBackend.availability`
probes the driver with ctypes first (see :mod:`hal_cuda._probe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from hal_cupy._arrays import to_device, to_host
from hal_cupy._cupy import cupy
from hal_cupy._device import CudaDevice

from hal_core import Availability, Backend
from hal_core.arrays import device_of

from ._probe import probe

if TYPE_CHECKING:
    from hal_core.ops import OpRegistry

__all__ = ["CudaBackend"]

_CUDA_KINDS = ("cuda", "cuda_managed")


class CudaBackend(Backend):
    """NVIDIA GPUs: CuPy memory pools and streams, NVRTC-compiled kernels."""

    name = "cuda"
    priority = 100

    @classmethod
    def availability(cls) -> Availability:
        result = probe()
        return Availability(result.ok, result.reason, result.remedy)

    def __init__(self) -> None:
        count = int(cupy().cuda.runtime.getDeviceCount())
        self._devices = [CudaDevice(i) for i in range(count)]

    def devices(self) -> Sequence[CudaDevice]:
        return list(self._devices)

    def current_device(self) -> CudaDevice:
        """The device CuPy treats as current in this thread."""
        return self._devices[int(cupy().cuda.runtime.getDevice())]

    def register_ops(self, registry: OpRegistry) -> None:
        from hal_cupy.ops import register_ops

        register_ops(registry)

    def owns(self, array: Any) -> bool:
        if isinstance(array, np.ndarray):
            return False
        if device_of(array)[0] in _CUDA_KINDS:
            return True
        return hasattr(array, "__cuda_array_interface__")

    def to_numpy(self, array: Any) -> np.ndarray:
        return to_host(array)

    def asarray(self, array: Any, device: int | None = None) -> Any:
        index = int(cupy().cuda.runtime.getDevice()) if device is None else int(device)
        return to_device(array, index)
