"""The CPU backend: the host as one device, numpy as the memory domain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from hal_core import Availability, Backend
from hal_core.arrays import BFLOAT16, TaggedArray

from ._device import CpuDevice

if TYPE_CHECKING:
    from hal_core.ops import OpRegistry

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """Runs every op with compiled SIMD kernels on the host (numpy if they fail to load); available everywhere.

    Its arrays are numpy arrays (bf16 as ml_dtypes' ``bfloat16``).
    """

    name: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    is_host: ClassVar[bool] = True

    def __init__(self) -> None:
        self._devices = (CpuDevice(0),)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    def devices(self) -> Sequence[CpuDevice]:
        return self._devices

    def register_ops(self, registry: OpRegistry) -> None:
        from .ops import register_ops

        register_ops(registry)

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def to_numpy(self, array: Any) -> np.ndarray:
        """``array`` as numpy: a view for numpy and host DLPack arrays, else a copy."""
        if isinstance(array, np.ndarray):
            return array
        if isinstance(array, TaggedArray):
            storage = self.to_numpy(array.storage)
            return storage.view(BFLOAT16) if array.hal_dtype == "bf16" else storage
        get = getattr(array, "get", None)  # CuPy-style device arrays copy to the host
        if callable(get) and not hasattr(array, "__array__"):
            return np.asarray(get())
        if hasattr(array, "__dlpack__") and not hasattr(array, "__array__"):
            return np.from_dlpack(array)
        return np.asarray(array)

    def asarray(self, array: Any, device: int | None = None) -> np.ndarray:
        """``array`` as a numpy array on the host (``device`` must be None or 0)."""
        if device not in (None, 0):
            raise IndexError(f"backend 'cpu' has 1 device; no index {device}")
        return self.to_numpy(array)
