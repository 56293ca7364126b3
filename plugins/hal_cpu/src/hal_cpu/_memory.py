"""The host allocator: aligned numpy byte buffers, a size-class cache and real statistics.

Sizes are rounded up to the granularity (64 bytes, a cache line). With
caching on (the default) a freed block is kept in a pool keyed by its
rounded size and handed out again for the same size class; ``reserved``
counts blocks in use plus blocks cached. A limit set with
:meth:`CpuAllocator.set_limit` caps ``reserved``: an allocation that would
pass it first empties the cache, then raises
:class:`~hal_core.DeviceOutOfMemoryError` with the byte counts.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from hal_core import AllocationPolicy, Allocator, AllocatorStats, DeviceBuffer, DeviceOutOfMemoryError, Stream

__all__ = ["CpuAllocator", "CpuBuffer"]


def _aligned_bytes(nbytes: int, alignment: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose first byte is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes]


class _Pin:
    """The owner numpy sees behind an :meth:`CpuBuffer.as_array` view: keeps the buffer and its block alive.

    A view's ``base`` chain ends here, so while any view lives its buffer is
    not collected, and garbage collection never returns memory a view uses
    to the allocator's cache.
    """

    __slots__ = ("__array_interface__", "block", "buffer")

    def __init__(self, buffer: CpuBuffer, block: np.ndarray) -> None:
        self.buffer = buffer
        self.block = block  # even after an explicit free(), the memory stays mapped while a view lives
        self.__array_interface__ = block.__array_interface__


class CpuBuffer(DeviceBuffer):
    """A block of host memory from a :class:`CpuAllocator`.

    Views from :meth:`as_array` share the memory and keep the buffer alive:
    it returns to the allocator when it is freed explicitly (:meth:`free`,
    leaving a ``with`` block) or when neither the buffer nor any view is
    referenced any more. After an explicit :meth:`free` the block may be
    handed out again while old views still see it (as on CUDA), so do not
    use views after freeing their buffer.
    """

    def __init__(self, allocator: CpuAllocator, block: np.ndarray, requested: int) -> None:
        self._allocator: CpuAllocator | None = allocator
        self._block: np.ndarray | None = block
        self._requested = requested

    @property
    def nbytes(self) -> int:
        """The bytes requested (the block behind may be larger, see ``capacity``)."""
        return self._requested

    @property
    def capacity(self) -> int:
        """Bytes of the block behind the buffer (the rounded size); 0 once freed."""
        return 0 if self._block is None else int(self._block.nbytes)

    @property
    def ptr(self) -> int:
        return 0 if self._block is None else int(self._block.ctypes.data)

    def free(self) -> None:
        allocator, block = self._allocator, self._block
        self._allocator = self._block = None
        if allocator is not None and block is not None:
            allocator._release(block)

    def as_array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        if self._block is None:
            raise ValueError("the buffer was freed; allocate a new one")
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if needed > self._requested:
            raise ValueError(f"shape {shape} of {dtype} needs {needed} bytes; the buffer holds {self._requested}")
        return np.asarray(_Pin(self, self._block))[:needed].view(dtype).reshape(shape)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the allocator may already be gone
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self._block is None else f"ptr={self.ptr:#x}"
        return f"<CpuBuffer {self._requested} bytes {state}>"


class CpuAllocator(Allocator):
    """Host allocator with statistics, an optional size-class cache and an optional limit."""

    def __init__(self, *, granularity: int = 64, caching: bool = True, device: str = "cpu") -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two, got {granularity}")
        self._granularity = granularity
        self._caching = caching
        self._device = device
        self._lock = threading.Lock()
        self._cache: dict[int, list[np.ndarray]] = {}
        self._cached_bytes = 0
        self._in_use = 0
        self._peak = 0
        self._allocations = 0
        self._limit: int | None = None

    @property
    def policy(self) -> AllocationPolicy:
        return AllocationPolicy.CACHING if self._caching else AllocationPolicy.HOST

    @property
    def granularity(self) -> int:
        return self._granularity

    def allocate(self, nbytes: int, stream: Stream | None = None) -> CpuBuffer:
        """A buffer of ``nbytes`` (host memory is not stream-ordered; ``stream`` is ignored)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = self.round_up(nbytes)
        with self._lock:
            block = self._take_cached(size)
            if block is None:
                self._make_room(size, nbytes)
            else:
                self._account(size)
                return CpuBuffer(self, block, nbytes)
            self._account(size)  # reserve before allocating outside the lock
        try:
            block = _aligned_bytes(size, self._granularity)
        except MemoryError as exc:
            with self._lock:
                self._in_use -= size
                self._allocations -= 1
            raise DeviceOutOfMemoryError(nbytes, -1, -1, self._device) from exc
        return CpuBuffer(self, block, nbytes)

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(in_use=self._in_use, peak=self._peak, reserved=self._in_use + self._cached_bytes,
                                  allocations=self._allocations, limit=self._limit)

    def empty_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def set_limit(self, nbytes: int | None) -> None:
        """Cap the bytes held (in use plus cached); None removes the cap."""
        if nbytes is not None and int(nbytes) < 0:
            raise ValueError(f"limit must be >= 0 or None, got {nbytes}")
        with self._lock:
            self._limit = None if nbytes is None else int(nbytes)

    # -- internals (called with the lock held, except _release) ------------

    def _take_cached(self, size: int) -> np.ndarray | None:
        blocks = self._cache.get(size)
        if not blocks:
            return None
        self._cached_bytes -= size
        return blocks.pop()

    def _make_room(self, size: int, requested: int) -> None:
        if self._limit is None or self._in_use + self._cached_bytes + size <= self._limit:
            return
        self._cache.clear()
        self._cached_bytes = 0
        if self._in_use + size > self._limit:
            raise DeviceOutOfMemoryError(requested, max(0, self._limit - self._in_use), self._limit, self._device)

    def _account(self, size: int) -> None:
        self._in_use += size
        self._allocations += 1
        self._peak = max(self._peak, self._in_use)

    def _release(self, block: np.ndarray) -> None:
        size = int(block.nbytes)
        with self._lock:
            self._in_use -= size
            self._allocations -= 1
            fits = self._limit is None or self._in_use + self._cached_bytes + size <= self._limit
            if self._caching and fits:
                self._cache.setdefault(size, []).append(block)
                self._cached_bytes += size
