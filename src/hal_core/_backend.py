"""The backend contract: what a plugin provides for one kind of hardware."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from ._device import DeviceHandle

# Annotations only: the contract sits below the ops layer, whose front door is handed to the backend when hal
# binds it (Ops.attach -> bind_ops), so nothing here imports hal_core.ops at run time (tests/test_layering.py).
if TYPE_CHECKING:
    from .ops import OpRegistry, Ops

__all__ = ["Availability", "Backend"]


class Availability(NamedTuple):
    """Whether a backend can run here; ``reason`` and ``remedy`` say why not and what to do.

    ``ok`` must be a ``bool`` and ``reason``/``remedy`` strings: hal treats
    anything else an ``availability()`` returns as a broken backend.
    """

    ok: bool
    reason: str = ""
    remedy: str = ""


class Backend(ABC):
    """One kind of hardware: its devices, its memory domain and its op implementations.

    Subclasses set :attr:`name` and :attr:`priority` (higher wins automatic
    selection; the CPU backend is 0) and implement every abstract method;
    discovery refuses a class that leaves one out. Instances are made by
    hal only after :meth:`availability` said yes; hal then builds the
    instance's :attr:`ops` (its implementations, the fallback backend and
    the extra implementations other plugins are allowed to add).
    """

    name: ClassVar[str]
    priority: ClassVar[int]
    #: True when this backend's arrays are host numpy arrays. A host backend
    #: is what a device backend falls back to; the available host backend
    #: with the lowest priority (hal-cpu) is that fallback.
    is_host: ClassVar[bool] = False
    #: DLPack device type codes (``dlpack.h``'s ``DLDeviceType``) whose memory
    #: this backend addresses without a copy; :meth:`from_dlpack` imports
    #: such arrays. Empty for host backends (host memory is code 1, always
    #: viewed through numpy).
    dlpack_device_types: ClassVar[frozenset[int]] = frozenset()
    #: The front door, given by :meth:`bind_ops` when hal binds the backend.
    _hal_ops: Ops | None = None

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here.

        Must be cheap and side-effect free: no device context, no
        environment change, and no vendor SDK import it can avoid. hal runs
        it once per process (until :func:`hal_core.reset`), outside every
        lock, under a time limit (``HAL_PROBE_TIMEOUT_S``).
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

    def from_dlpack(self, value: Any) -> Any:
        """A zero-copy array of this backend over ``value``, a DLPack producer.

        Called by the ops front door for a foreign array whose DLPack device
        type is in :attr:`dlpack_device_types`. The result must share
        ``value``'s memory; hal compares the data pointers where it can.
        Host backends inherit a numpy view; a device backend must implement
        this for its array library.
        """
        if self.is_host:
            return np.from_dlpack(value)
        raise NotImplementedError(
            f"backend {self.name!r} lists DLPack device types {sorted(self.dlpack_device_types)} "
            f"but does not implement from_dlpack"
        )

    def check_errors(self) -> None:
        """Raise what this backend's devices recorded asynchronously since the last check, then forget it.

        Device kernels check the index values they read (block tables,
        lengths, slots) and, instead of dereferencing a bad one, record which
        argument held it in a device error flag; this method waits for the
        devices' queued work, reads the flags and raises
        :class:`~hal_core.ArgumentError` naming the argument(s), as a device
        reports an asynchronous fault at the next synchronisation. A device
        backend also does this at the synchronisation points it controls
        (its ``Stream``/``Event``/``DeviceHandle`` ``synchronize``). Host
        backends check eagerly, before any work, so the default does nothing.
        Never call it while a stream is being captured into a graph.
        """
        return None

    def on_reset(self) -> None:
        """Drop per-process caches (compiled kernels, pools); called by :func:`hal_core.reset`.

        hal forgets this instance right after; the default does nothing.
        """
        return None

    def device(self, index: int = 0) -> DeviceHandle:
        """The device with this index."""
        found = self.devices()
        if not 0 <= index < len(found):
            raise IndexError(f"backend {self.name!r} has {len(found)} device(s); no index {index}")
        return found[index]

    @property
    def ops(self) -> Ops:
        """The ops front door: validated, dispatched, with a correct fallback.

        Built by hal when it binds the backend (:func:`hal_core.get_backend`).
        An instance made by hand has none until
        :meth:`hal_core.ops.Ops.attach` gives it one.
        """
        ops = self._hal_ops
        if ops is None:
            raise RuntimeError(
                f"backend {self.name!r} is not bound: get it with hal_core.get_backend({self.name!r}), "
                f"or give this instance a front door with hal_core.ops.Ops.attach(backend)"
            )
        return ops

    def bind_ops(self, ops: Ops) -> None:
        """Make ``ops`` this instance's front door (:meth:`hal_core.ops.Ops.attach` calls it when hal binds it)."""
        self._hal_ops = ops

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority}>"
