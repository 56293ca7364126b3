"""Allocators and the device buffers they hand out."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ._stream import Stream

__all__ = ["AllocationPolicy", "Allocator", "AllocatorStats", "DeviceBuffer"]


class AllocationPolicy(str, enum.Enum):
    """How an allocator obtains memory."""

    CACHING = "caching"  #: a pool that keeps freed blocks for reuse
    ASYNC = "async"  #: stream-ordered allocation by the driver
    MANAGED = "managed"  #: unified memory, falling back to device memory
    HOST = "host"  #: plain host memory


@dataclass(frozen=True)
class AllocatorStats:
    """Byte counts of one allocator at one moment."""

    in_use: int
    peak: int
    reserved: int
    allocations: int
    limit: int | None = None


class DeviceBuffer(ABC):
    """A block of device memory; freed explicitly, on context exit, or when collected."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        raise NotImplementedError("The 'nbytes' property must be implemented.")

    @property
    @abstractmethod
    def ptr(self) -> int:
        """Address of the first byte (0 once freed)."""
        raise NotImplementedError("The 'ptr' property must be implemented.")

    @abstractmethod
    def free(self) -> None:
        """Return the memory to its allocator; idempotent."""
        raise NotImplementedError("The 'free' method must be implemented.")

    @abstractmethod
    def as_array(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """View the buffer as an array of the backend's array library (no copy)."""
        raise NotImplementedError("The 'as_array' method must be implemented.")

    @property
    def freed(self) -> bool:
        return self.ptr == 0

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class Allocator(ABC):
    """Hands out :class:`DeviceBuffer` objects for one device and keeps statistics.

    An allocation that cannot be satisfied frees cached blocks, retries once,
    then raises :class:`~hal_core.DeviceOutOfMemoryError` with byte counts.
    """

    @property
    @abstractmethod
    def policy(self) -> AllocationPolicy:
        raise NotImplementedError("The 'policy' property must be implemented.")

    @property
    @abstractmethod
    def granularity(self) -> int:
        """Sizes are rounded up to a multiple of this many bytes."""
        raise NotImplementedError("The 'granularity' property must be implemented.")

    @abstractmethod
    def allocate(self, nbytes: int, stream: Stream | None = None) -> DeviceBuffer:
        """A buffer of at least ``nbytes`` bytes, ordered on ``stream`` where supported."""
        raise NotImplementedError("The 'allocate' method must be implemented.")

    @abstractmethod
    def stats(self) -> AllocatorStats:
        raise NotImplementedError("The 'stats' method must be implemented.")

    @abstractmethod
    def empty_cache(self) -> None:
        """Release cached, unused blocks back to the device."""
        raise NotImplementedError("The 'empty_cache' method must be implemented.")

    def set_limit(self, nbytes: int | None) -> None:
        """Cap the bytes this allocator may hold (None: no cap)."""
        raise NotImplementedError(f"{type(self).__name__} does not support limits")

    def round_up(self, nbytes: int) -> int:
        g = self.granularity
        return max(g, -(-int(nbytes) // g) * g)
