"""Allocators over CuPy's memory pools.

- ``caching`` (default): a CuPy ``MemoryPool`` of its own, so its statistics
  and limit count exactly the buffers handed out here (arrays the ops
  create come from CuPy's default pool).
- ``async``: a ``MemoryAsyncPool`` (stream-ordered ``cudaMallocAsync``), where
  the device reports memory-pool support. It draws from the device's current
  CUDA mempool, shared by the whole process: its statistics count every
  allocation from that mempool, and its limit is the mempool's release
  threshold (a soft, process-wide limit CuPy checks before growing the pool).
- ``managed``: a pool of unified memory that falls back to device memory
  when the device has no managed memory, when a request exceeds the bytes
  the device has free (never asking for more, see the device notes), or
  when the managed allocation fails.

An allocation that fails frees the cached blocks of this pool and of CuPy's
default pool, retries once, then raises
:class:`hal_core.DeviceOutOfMemoryError` with byte counts. Never a silent
CPU fallback.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy as np

from hal_core import AllocationPolicy, Allocator, AllocatorStats, DeviceBuffer, DeviceOutOfMemoryError, Stream
from hal_core.arrays import BFLOAT16, TaggedArray

from ._cupy import cupy
from ._stream import native_stream

__all__ = ["CupyAllocator", "CupyBuffer", "is_out_of_memory"]

log = logging.getLogger("hal")

_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation; hipErrorOutOfMemory is 2 as well
#: A limit at or above this means none: CuPy's MemoryAsyncPool stores "no limit" as UINT64_MAX.
_NO_LIMIT = 2**63


def _limit_or_none(limit: int) -> int | None:
    """A pool's ``get_limit()`` as AllocatorStats.limit: 0 and UINT64_MAX-like values are no limit."""
    return None if limit <= 0 or limit >= _NO_LIMIT else limit


def is_out_of_memory(exc: BaseException, cp: Any) -> bool:
    """Whether ``exc`` is CuPy's way of saying the device is out of memory."""
    if isinstance(exc, cp.cuda.memory.OutOfMemoryError):
        return True
    runtime_error = getattr(cp.cuda.runtime, "CUDARuntimeError", None)
    return (runtime_error is not None and isinstance(exc, runtime_error)
            and getattr(exc, "status", None) == _CUDA_ERROR_MEMORY_ALLOCATION)


class _Release:
    """Runs a callback once: on ``free()`` or when the buffer is collected (holds no buffer reference)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def __call__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class CupyBuffer(DeviceBuffer):
    """A ``cupy.cuda.MemoryPointer`` handed out by :class:`CupyAllocator`."""

    def __init__(self, memptr: Any, nbytes: int, device_index: int, on_free: Any = None) -> None:
        self._mem = memptr
        self._nbytes = int(nbytes)
        self._device_index = device_index
        self._release = _Release(on_free)
        weakref.finalize(self, self._release)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def ptr(self) -> int:
        return 0 if self._mem is None else int(self._mem.ptr)

    @property
    def memptr(self) -> Any:
        """The CuPy ``MemoryPointer`` (None once freed)."""
        return self._mem

    def free(self) -> None:
        """Return the block to its pool; arrays viewing it keep it alive until they go."""
        self._mem = None
        self._release()

    def as_array(self, shape: tuple[int, ...], dtype: Any) -> Any:
        if self._mem is None:
            raise ValueError("buffer was freed")
        cp = cupy()
        bf16 = dtype == "bf16" or (not isinstance(dtype, str) and np.dtype(dtype) == BFLOAT16)
        storage_dtype = np.dtype(np.uint16) if bf16 else np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * storage_dtype.itemsize > self._nbytes:
            raise ValueError(f"shape {tuple(shape)} of {storage_dtype} needs {count * storage_dtype.itemsize} "
                             f"bytes; the buffer has {self._nbytes}")
        with cp.cuda.Device(self._device_index):
            array = cp.ndarray(tuple(shape), dtype=storage_dtype, memptr=self._mem)
        return TaggedArray(array, "bf16") if bf16 else array


class CupyAllocator(Allocator):
    """One device's allocator with a fixed :class:`~hal_core.AllocationPolicy`."""

    def __init__(self, device_index: int, policy: AllocationPolicy | str = AllocationPolicy.CACHING, *,
                 name: str = "", async_supported: bool = True, managed_supported: bool = True) -> None:
        policy = AllocationPolicy(policy)
        if policy is AllocationPolicy.HOST:
            raise ValueError("a GPU backend has no host allocator policy")
        if policy is AllocationPolicy.ASYNC and not async_supported:
            log.info("hal: device %d has no stream-ordered memory pools; using the caching pool", device_index)
            policy = AllocationPolicy.CACHING
        self._device_index = device_index
        self._policy = policy
        self._name = name or f"gpu:{device_index}"
        self._managed_supported = managed_supported
        self._lock = threading.Lock()
        self._peak = 0
        self._live = 0
        self._pool: Any = None
        self._initial_limit = 0  # the pool's limit once made; set_limit(None) restores it

    # -- pool ---------------------------------------------------------------

    @property
    def pool(self) -> Any:
        """The CuPy memory pool underneath (made on first use)."""
        if self._pool is None:
            cp = cupy()
            with cp.cuda.Device(self._device_index):
                if self._policy is AllocationPolicy.CACHING:
                    pool = cp.cuda.MemoryPool()
                elif self._policy is AllocationPolicy.ASYNC:
                    pool = cp.cuda.MemoryAsyncPool()
                else:
                    pool = cp.cuda.MemoryPool(self._managed_or_device)
                # CUPY_GPU_MEMORY_LIMIT's value, or none (0; UINT64_MAX for the async pool)
                self._initial_limit = int(pool.get_limit())
                self._pool = pool
        return self._pool

    def _managed_or_device(self, nbytes: int) -> Any:
        """Managed memory when supported and no larger than the free device memory; device memory otherwise."""
        cp = cupy()
        if self._managed_supported:
            free, _total = cp.cuda.runtime.memGetInfo()
            if nbytes <= free:
                try:
                    return cp.cuda.malloc_managed(nbytes)
                except Exception as exc:
                    if not is_out_of_memory(exc, cp) and not isinstance(exc, cp.cuda.runtime.CUDARuntimeError):
                        raise
                    log.info("hal: managed allocation of %d bytes failed (%s); using device memory", nbytes, exc)
        return cp.cuda.MemoryPointer(cp.cuda.memory.Memory(nbytes), 0)

    # -- contract -----------------------------------------------------------

    @property
    def policy(self) -> AllocationPolicy:
        return self._policy

    @property
    def granularity(self) -> int:
        return 512

    def allocate(self, nbytes: int, stream: Stream | Any = None) -> CupyBuffer:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        cp = cupy()
        pool = self.pool
        with cp.cuda.Device(self._device_index), native_stream(stream, self._device_index):
            try:
                mem = pool.malloc(nbytes)
            except Exception as exc:
                if not is_out_of_memory(exc, cp):
                    raise
                pool.free_all_blocks()
                cp.get_default_memory_pool().free_all_blocks()  # the ops' temporaries cache there
                try:
                    mem = pool.malloc(nbytes)
                except Exception as retry_exc:
                    if not is_out_of_memory(retry_exc, cp):
                        raise
                    free, total = cp.cuda.runtime.memGetInfo()
                    raise DeviceOutOfMemoryError(nbytes, free, total, self._name) from retry_exc
            used = int(pool.used_bytes())
        with self._lock:
            self._live += 1
            self._peak = max(self._peak, used)
        return CupyBuffer(mem, nbytes, self._device_index, on_free=self._released)

    def _released(self) -> None:
        with self._lock:
            self._live -= 1

    def stats(self) -> AllocatorStats:
        cp = cupy()
        pool = self.pool
        with cp.cuda.Device(self._device_index):
            used, reserved, limit = int(pool.used_bytes()), int(pool.total_bytes()), int(pool.get_limit())
        with self._lock:
            self._peak = max(self._peak, used)
            return AllocatorStats(in_use=used, peak=self._peak, reserved=reserved, allocations=self._live,
                                  limit=_limit_or_none(limit))

    def empty_cache(self) -> None:
        with cupy().cuda.Device(self._device_index):
            self.pool.free_all_blocks()

    def set_limit(self, nbytes: int | None) -> None:
        """Cap the pool at ``nbytes`` (rounded up to the granularity); None restores the limit the pool
        was made with (none, unless ``CUPY_GPU_MEMORY_LIMIT`` set one).

        For the async policy this sets the release threshold of the device's shared mempool: a soft
        limit, for the whole process (see docs/cuda.md).
        """
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"limit must be >= 0 or None, got {nbytes}")
        pool = self.pool
        if nbytes is None:
            size = 0 if _limit_or_none(self._initial_limit) is None else self._initial_limit
        else:
            size = self.round_up(nbytes)
        with cupy().cuda.Device(self._device_index):
            pool.set_limit(size=size)
