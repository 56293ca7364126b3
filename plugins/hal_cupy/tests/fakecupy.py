"""A small fake of the few CuPy objects hal-cupy's runtime touches, and a fake platform, for host-only tests.

It models memory as byte counts (no data): enough to test the allocator's
OOM retry and managed fallback, the launcher's compile cache, error mapping
and shared-memory opt-in, and stream wrapping, all without a GPU.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, ClassVar

from hal_cupy import GpuPlatform

from hal_core import Availability, DeviceCapabilities

_addresses = itertools.count(0x7F0000000000, 512)
UINT64_MAX = 2**64 - 1


class OutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(f"out of memory allocating {size} bytes (total {total})")


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


class CUDADriverError(RuntimeError):
    pass


class CompileException(Exception):
    def __init__(self, log: str) -> None:
        super().__init__(log)
        self._log = log

    def get_message(self) -> str:
        return self._log


class MemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


class Memory:
    """Device memory; ``kind`` records where it came from."""

    def __init__(self, size: int, gpu: FakeGPU | None = None, kind: str = "device") -> None:
        gpu = gpu or FakeCupy.current.gpu
        if size > gpu.free:
            raise CUDARuntimeError(2)
        gpu.free -= size
        self.size, self.kind, self.ptr = size, kind, next(_addresses)
        gpu.allocations.append((kind, size))


class FakeGPU:
    def __init__(self, total: int, managed_fails: bool = False) -> None:
        self.total = self.free = total
        self.managed_fails = managed_fails
        self.allocations: list[tuple[str, int]] = []
        self.managed_requests: list[int] = []


class MemoryPool:
    """Caches nothing; counts bytes in use and can be told to fail a number of times."""

    def __init__(self, allocator: Any = None) -> None:
        self.allocator = allocator or (lambda size: MemoryPointer(Memory(size), 0))
        self.used = 0
        self.limit = 0
        self.fail_next = 0
        self.freed_all = 0

    def malloc(self, size: int) -> MemoryPointer:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise OutOfMemoryError(size, 0)
        if self.limit and self.used + size > self.limit:
            raise OutOfMemoryError(size, self.used, self.limit)
        pointer = self.allocator(size)
        self.used += size
        return pointer

    def free_all_blocks(self) -> None:
        self.freed_all += 1

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used

    def get_limit(self) -> int:
        return self.limit

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self.limit = int(size or 0)


class MemoryAsyncPool:
    """CuPy 14's async pool over the device's one shared mempool (``FakeCupy.mempool``).

    As in CuPy, the limit is the mempool's release threshold, UINT64_MAX when
    set to 0, and every constructor sets it (from ``CUPY_GPU_MEMORY_LIMIT``:
    ``FakeCupy.env_limit``); used bytes count every pool on the mempool.
    """

    def __init__(self, pool_handles: Any = "current") -> None:
        self.shared = FakeCupy.current.mempool
        self.fail_next = 0
        self.freed_all = 0
        self.set_limit(size=FakeCupy.current.env_limit)

    def malloc(self, size: int) -> MemoryPointer:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise OutOfMemoryError(size, 0)
        if self.shared.used + size > self.shared.threshold:
            raise OutOfMemoryError(size, self.shared.used, self.shared.threshold)
        pointer = MemoryPointer(Memory(size), 0)
        self.shared.used += size
        return pointer

    def free_all_blocks(self, stream: Any = None) -> None:
        self.freed_all += 1

    def used_bytes(self) -> int:
        return self.shared.used

    def total_bytes(self) -> int:
        return self.shared.used

    def get_limit(self) -> int:
        return self.shared.threshold

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self.shared.threshold = int(size or 0) or UINT64_MAX


class _Context:
    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Device(_Context):
    """Makes its index current inside ``with`` (``runtime.getDevice()`` answers it)."""

    def __init__(self, index: int = 0) -> None:
        self.id = index

    def __enter__(self) -> Device:
        FakeCupy.current.devices.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        FakeCupy.current.devices.pop()

    def synchronize(self) -> None:
        return None


class _BaseStream(_Context):
    def __init__(self, ptr: int = 0, device_id: int = -1) -> None:
        self.ptr = ptr
        self.device_id = device_id
        self.done = True
        self.waited: list[Any] = []

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class Stream(_BaseStream):
    null: Stream

    def __init__(self, non_blocking: bool = False) -> None:
        super().__init__(next(_addresses))

    @classmethod
    def from_external(cls, obj: Any) -> ExternalStream:
        """As CuPy 14: calls the ``__cuda_stream__()`` method; the device is the current one."""
        version, ptr = obj.__cuda_stream__()
        if version != 0:
            raise ValueError(f"unsupported __cuda_stream__ version {version}")
        stream = ExternalStream(ptr, FakeCupy.current.devices[-1])
        stream.foreign = obj
        return stream


Stream.null = _BaseStream(0)  # type: ignore[assignment]


class ExternalStream(_BaseStream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__(ptr, device_id)


class RawKernel:
    def __init__(self, name: str, attributes: dict[str, int]) -> None:
        self.name = name
        self._attributes = dict(attributes)
        self.calls: list[tuple[Any, ...]] = []
        self.kernel = SimpleNamespace(ptr=next(_addresses))

    @property
    def attributes(self) -> dict[str, int]:
        return dict(self._attributes)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attributes["max_dynamic_shared_size_bytes"]

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self._attributes["max_dynamic_shared_size_bytes"] = value

    def __call__(self, grid: Any, block: Any, args: Any, *, shared_mem: int = 0) -> None:
        self.calls.append((grid, block, args, shared_mem))


class RawModule:
    compiled: ClassVar[list[tuple[str, tuple[str, ...]]]] = []
    fail_with: ClassVar[str | None] = None
    attributes: ClassVar[dict[str, int]] = {"max_threads_per_block": 1024, "num_regs": 32, "shared_size_bytes": 0,
                  "max_dynamic_shared_size_bytes": 48 * 1024}

    def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
        self.code, self.options = code, tuple(options)

    def compile(self) -> None:
        if RawModule.fail_with is not None:
            raise CompileException(RawModule.fail_with)
        RawModule.compiled.append((self.code, self.options))

    def get_function(self, name: str) -> RawKernel:
        if name.startswith("missing"):
            raise CUDADriverError("CUDA_ERROR_NOT_FOUND: named symbol not found")
        return RawKernel(name, RawModule.attributes)


class FakeCupy:
    """The fake module; ``FakeCupy.current`` is the one installed by the ``fake_cupy`` fixture."""

    current: FakeCupy

    def __init__(self, total: int = 1 << 30, managed_fails: bool = False) -> None:
        FakeCupy.current = self
        self.gpu = FakeGPU(total, managed_fails)
        self.default_pool = MemoryPool()
        self.occupancy = 4
        self.mempool = SimpleNamespace(threshold=UINT64_MAX, used=0)  # the device's current CUDA mempool
        self.env_limit = 0  # CUPY_GPU_MEMORY_LIMIT, in bytes (0: unset)
        self.devices = [0]  # the current device is the last
        gpu = self.gpu

        def malloc_managed(size: int) -> MemoryPointer:
            gpu.managed_requests.append(size)
            if gpu.managed_fails:
                raise CUDARuntimeError(801)  # cudaErrorNotSupported
            return MemoryPointer(Memory(size, gpu, kind="managed"), 0)

        current_stream = Stream()
        self.cuda = SimpleNamespace(
            Device=Device,
            Stream=Stream,
            ExternalStream=ExternalStream,
            stream=SimpleNamespace(_BaseStream=_BaseStream),
            get_current_stream=lambda: current_stream,
            MemoryPool=MemoryPool,
            MemoryAsyncPool=MemoryAsyncPool,
            MemoryPointer=MemoryPointer,
            malloc_managed=malloc_managed,
            memory=SimpleNamespace(OutOfMemoryError=OutOfMemoryError, Memory=Memory),
            runtime=SimpleNamespace(CUDARuntimeError=CUDARuntimeError, memGetInfo=lambda: (gpu.free, gpu.total),
                                    getDevice=lambda: self.devices[-1]),
            compiler=SimpleNamespace(CompileException=CompileException),
            driver=SimpleNamespace(CUDADriverError=CUDADriverError,
                                   occupancyMaxActiveBlocksPerMultiprocessor=lambda f, t, s: self.occupancy),
        )
        self.RawModule = RawModule
        RawModule.compiled = []
        RawModule.fail_with = None

    def get_default_memory_pool(self) -> MemoryPool:
        return self.default_pool


class FakePlatform(GpuPlatform):
    """A vendor interface for host-only tests: a one-line prelude, no compiler options of its own."""

    name: ClassVar[str] = "fake"
    dlpack_device_types: ClassVar[frozenset[int]] = frozenset({2})

    def availability(self) -> Availability:
        return Availability(True)

    def capabilities(self, props: Any, attributes: Any, *, memory_free: int | None = None) -> DeviceCapabilities:
        raise NotImplementedError("FakePlatform reads no device properties; use hal_core.load_profile")

    def prelude(self) -> str:
        return "#define HAL_PRELUDE 1\n"

    def __init__(self, mma_level: int = 0) -> None:
        self.mma_level = mma_level

    def compile_options(self, *, fmad: bool) -> tuple[str, ...]:
        return () if fmad else ("-fake-no-fmad",)

    def warp_mma_level(self, capabilities: DeviceCapabilities) -> int:
        """``mma_level`` (what the test says the prelude provides)."""
        return self.mma_level
