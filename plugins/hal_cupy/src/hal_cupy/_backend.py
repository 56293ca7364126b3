"""The shared GPU backend: every visible device of one vendor's platform, through CuPy.

A vendor plugin subclasses :class:`CupyBackend` with its ``name``,
``priority`` and ``platform`` (a :class:`~hal_cupy.GpuPlatform`). Importing
this module imports no CuPy; :meth:`CupyBackend.availability` asks the
platform's probe, which answers before any CuPy import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from hal_core import Availability, Backend
from hal_core.arrays import TaggedArray

from ._arrays import as_storage, to_device, to_host
from ._cupy import cupy
from ._device import CupyDevice
from ._index_errors import forget_flags, has_flag
from ._platform import GpuPlatform

if TYPE_CHECKING:
    from hal_core.ops import OpRegistry

__all__ = ["CupyBackend"]


class CupyBackend(Backend):
    """GPUs of one platform: CuPy memory pools and streams, kernels compiled by the platform's runtime compiler."""

    #: The vendor interface; set by the vendor plugin's subclass.
    platform: ClassVar[GpuPlatform]
    #: Device memory, not the host's.
    is_host: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        platform = cls.__dict__.get("platform")
        if platform is not None:
            cls.dlpack_device_types = platform.dlpack_device_types

    @classmethod
    def availability(cls) -> Availability:
        return cls.platform.availability()

    def __init__(self) -> None:
        count = int(cupy().cuda.runtime.getDeviceCount())
        self._devices = [self.make_device(i) for i in range(count)]

    def make_device(self, index: int) -> CupyDevice:
        """The handle of device ``index`` (a vendor plugin may return a subclass)."""
        return CupyDevice(index, self.platform)

    def devices(self) -> Sequence[CupyDevice]:
        return list(self._devices)

    def register_ops(self, registry: OpRegistry) -> None:
        from .ops import register_ops
        from .ops._quantized_gemm import w4a8_everywhere

        register_ops(registry, self.name, w4a8=w4a8_everywhere(self))

    def owns(self, array: Any) -> bool:
        """Arrays in this platform's memory (DLPack device type), or exposing ``__cuda_array_interface__``."""
        if isinstance(array, np.ndarray):
            return False
        probe = getattr(array, "__dlpack_device__", None)
        if probe is not None:
            try:
                kind = int(probe()[0])
            except Exception:  # a foreign object whose probe fails is simply not ours
                return False
            if kind in self.platform.dlpack_device_types:
                return True
        return hasattr(array, "__cuda_array_interface__")

    def to_numpy(self, array: Any) -> np.ndarray:
        return to_host(array)

    def asarray(self, array: Any, device: int | None = None) -> Any:
        index = int(cupy().cuda.runtime.getDevice()) if device is None else int(device)
        return to_device(array, index)

    def from_dlpack(self, value: Any) -> Any:
        """A CuPy array sharing ``value``'s memory (``__cuda_array_interface__`` or DLPack), never a copy.

        A :class:`~hal_core.arrays.TaggedArray` (bf16 storage) is already a device array and comes back as it is.
        """
        if isinstance(value, TaggedArray):
            return value
        return as_storage(value)

    def check_errors(self) -> None:
        """Synchronise every device whose kernels may have recorded an index error, and raise it.

        Devices no checked kernel has run on are left alone (no context is made for them).
        """
        for device in self._devices:
            if has_flag(device.index):
                device.synchronize()

    def on_reset(self) -> None:
        """Forget the compiled kernels looked up by the op implementations (the launchers keep their own)
        and the devices' error flags."""
        from .ops._common import forget_kernels

        forget_kernels()
        forget_flags()
