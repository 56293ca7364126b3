"""The device handle: one device, its streams, memory and launcher."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from ._launch import KernelLauncher
from ._memory import Allocator
from ._stream import Event, Stream

if TYPE_CHECKING:
    from ._capabilities import DeviceCapabilities

__all__ = ["DeviceHandle"]


class DeviceHandle(ABC):
    """One device of a backend.

    Creating a handle is cheap; contexts and pools are made on first use.
    """

    @property
    @abstractmethod
    def index(self) -> int:
        raise NotImplementedError("The 'index' property must be implemented.")

    @property
    @abstractmethod
    def capabilities(self) -> DeviceCapabilities:
        raise NotImplementedError("The 'capabilities' property must be implemented.")

    @property
    @abstractmethod
    def default_stream(self) -> Stream:
        raise NotImplementedError("The 'default_stream' property must be implemented.")

    def current_stream(self) -> Stream:
        """The stream ops enqueue on from this thread (the library's notion of "current").

        The default is :attr:`default_stream`; a backend whose library has a
        per-thread current stream (``with stream:``) returns that one.
        """
        return self.default_stream

    def wrap_stream(self, foreign: Any) -> Stream:
        """A :class:`Stream` over another library's stream on this device (e.g. torch's current stream); not owned.

        ``with device.wrap_stream(s):`` makes it the current stream, so ops enqueue on it without a
        copy or a synchronisation (how ``torch.ops.hal`` follows torch's stream). The default refuses:
        a backend whose devices have no foreign streams (a host backend) never needs it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot wrap a foreign stream ({type(foreign).__name__}); "
            f"its backend has no streams of other libraries"
        )

    @abstractmethod
    def create_stream(self) -> Stream:
        """A new stream, ordered independently of the others."""
        raise NotImplementedError("The 'create_stream' method must be implemented.")

    @abstractmethod
    def create_event(self, *, timing: bool = True) -> Event:
        """A new event; ``timing=False`` may be cheaper where timing is not needed."""
        raise NotImplementedError("The 'create_event' method must be implemented.")

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all work on every stream of this device has completed.

        Prefer events; this is for teardown and benchmarks.
        """
        raise NotImplementedError("The 'synchronize' method must be implemented.")

    @property
    @abstractmethod
    def allocator(self) -> Allocator:
        raise NotImplementedError("The 'allocator' property must be implemented.")

    @property
    @abstractmethod
    def launcher(self) -> KernelLauncher:
        raise NotImplementedError("The 'launcher' property must be implemented.")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.index}: {self.capabilities.name}>"
