"""The backend contract: what a plugin provides for one kind of hardware."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from ._device import DeviceHandle

if TYPE_CHECKING:
    from .ops import OpRegistry, Ops

__all__ = ["Availability", "Backend"]


class Availability(NamedTuple):
    """Whether a backend can run here; ``reason`` and ``remedy`` say why not and what to do."""

    ok: bool
    reason: str = ""
    remedy: str = ""


class Backend(ABC):
    """One kind of hardware: its devices, its memory domain and its op implementations.

    Subclasses set :attr:`name` and :attr:`priority` (higher wins automatic
    selection; the CPU backend is 0) and implement every abstract method;
    discovery refuses a class that leaves one out. Instances are made by
    hal only after :meth:`availability` said yes.
    """

    name: ClassVar[str]
    priority: ClassVar[int]
    #: The HAL API version this class was written against; None defers to the
    #: version its plugin declares through ``hal_api_version``.
    api_version: ClassVar[tuple[int, int] | None] = None

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here.

        Must be cheap and side-effect free: no device context, no
        environment change, and no vendor SDK import it can avoid.
        """
        raise NotImplementedError("The 'availability' classmethod must be implemented.")

    @abstractmethod
    def devices(self) -> Sequence[DeviceHandle]:
        """Every usable device, in index order (at least one)."""
        raise NotImplementedError("The 'devices' method must be implemented.")

    @abstractmethod
    def register_ops(self, registry: OpRegistry) -> None:
        """Register this backend's op implementations with ``registry.register(...)``."""
        raise NotImplementedError("The 'register_ops' method must be implemented.")

    @abstractmethod
    def owns(self, array: Any) -> bool:
        """Whether ``array`` lives in this backend's memory domain (no copy needed)."""
        raise NotImplementedError("The 'owns' method must be implemented.")

    @abstractmethod
    def to_numpy(self, array: Any) -> np.ndarray:
        """Copy (or view, for host memory) ``array`` as a numpy array."""
        raise NotImplementedError("The 'to_numpy' method must be implemented.")

    @abstractmethod
    def asarray(self, array: Any, device: int | None = None) -> Any:
        """``array`` in this backend's memory domain on ``device`` (current if None)."""
        raise NotImplementedError("The 'asarray' method must be implemented.")

    def device(self, index: int = 0) -> DeviceHandle:
        """The device with this index."""
        found = self.devices()
        if not 0 <= index < len(found):
            raise IndexError(f"backend {self.name!r} has {len(found)} device(s); no index {index}")
        return found[index]

    @property
    def ops(self) -> Ops:
        """The ops front door: validated, dispatched, with a correct fallback."""
        ops = self.__dict__.get("_hal_ops")
        if ops is None:
            from .ops import Ops

            ops = self.__dict__["_hal_ops"] = Ops(self)
        return ops

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority}>"
