"""The CUDA backend: every visible NVIDIA GPU through CuPy.

Importing this module imports no CuPy; :meth:`CudaBackend.availability`
probes the driver with ctypes first (see :mod:`hal_cuda._probe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hal_core import Availability, Backend
from hal_core.arrays import dlpack_device

from ._arrays import to_device, to_host
from ._cupy import cupy
from ._device import CudaDevice
from ._probe import probe

if TYPE_CHECKING:
    from hal_core.ops import OpRegistry

__all__ = ["CudaBackend"]

#: DLPack device types of CUDA memory: device (kDLCUDA) and managed (kDLCUDAManaged).
_CUDA_DLPACK_TYPES = frozenset({2, 13})


class CudaBackend(Backend):
    """NVIDIA GPUs: CuPy memory pools and streams, NVRTC-compiled kernels."""

    name = "cuda"
    priority = 100
    dlpack_device_types = _CUDA_DLPACK_TYPES

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
        from .ops import register_ops

        register_ops(registry)

    def on_reset(self) -> None:
        """Forget the compiled-kernel lookups of this process (``hal_core.reset``)."""
        from .ops._common import forget_loaded

        forget_loaded()

    def owns(self, array: Any) -> bool:
        if isinstance(array, np.ndarray):
            return False
        found = dlpack_device(array)
        if found is not None and found[0] in _CUDA_DLPACK_TYPES:
            return True
        return hasattr(array, "__cuda_array_interface__")

    def from_dlpack(self, value: Any) -> Any:
        """A CuPy view of a CUDA DLPack producer (no copy)."""
        return cupy().from_dlpack(value)

    def to_numpy(self, array: Any) -> np.ndarray:
        return to_host(array)

    def asarray(self, array: Any, device: int | None = None) -> Any:
        index = int(cupy().cuda.runtime.getDevice()) if device is None else int(device)
        return to_device(array, index)
