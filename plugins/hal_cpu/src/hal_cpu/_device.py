"""The host as a hal device: capabilities read from the machine, streams, allocator, launcher."""

from __future__ import annotations

import os
import platform
import threading
import weakref
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from hal_core import DeviceHandle

from . import _native
from ._launcher import CpuLauncher
from ._memory import CpuAllocator
from ._stream import CpuEvent, CpuStream, _WorkQueue

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["CpuDevice", "host_capabilities"]

#: fp32 lanes per vector register, best first: (cpuinfo flag, arch suffix, lanes).
_X86_SIMD = (("avx512f", "avx512", 16), ("avx2", "avx2", 8), ("avx", "avx", 8), ("sse2", "sse2", 4))
_ARM_SIMD = (("sve", "sve", 4), ("asimd", "neon", 4), ("neon", "neon", 4))

# A CPU has no thread blocks; a "block" of a host kernel is one call that
# vectorises over its threads with numpy, so these limits are conventions,
# chosen equal to CUDA's so one launch configuration is valid on both.
MAX_THREADS_PER_BLOCK = 1024
#: Threads resident per core: four 256-thread blocks, which lets grid_for
#: size grids at a few blocks per core for load balance.
MAX_THREADS_PER_CU = 1024
MAX_BLOCK_DIMS = (1024, 1024, 64)
MAX_GRID_DIMS = (2**31 - 1, 65535, 65535)
#: Scratch ("shared memory") a block may ask for: L1d-sized by default, L2-sized after opt-in.
DEFAULT_L1D = 32 * 1024
DEFAULT_L2 = 1024 * 1024
ALLOCATION_GRANULARITY = 64  # a cache line, and AVX-512 alignment


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _simd(machine: str, flags: set[str]) -> tuple[str, int]:
    """``(arch suffix, fp32 lanes)`` of the widest vector unit the flags show."""
    table: tuple[tuple[str, str, int], ...]
    if machine in ("x86_64", "amd64", "i686", "i386"):
        table = _X86_SIMD
    elif machine in ("aarch64", "arm64") or machine.startswith("arm"):
        table = _ARM_SIMD
        if machine in ("aarch64", "arm64"):
            flags = flags | {"asimd"}  # AdvSIMD is mandatory on AArch64
    else:
        return "generic", 1
    for flag, suffix, lanes in table:
        if flag in flags:
            return suffix, lanes
    return "generic", 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory() -> tuple[int, int | None]:
    """``(total, available)`` bytes from /proc/meminfo, else sysconf."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree"))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        free = page * os.sysconf("SC_AVPHYS_PAGES")
        return total, free
    except (AttributeError, ValueError, OSError):
        return 0, None


def _cache_bytes(level: int, default: int) -> int:
    """Size of CPU 0's data/unified cache at ``level`` from sysfs."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
            factor = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            return int(text.rstrip("KMG")) * factor
    except (OSError, ValueError):
        pass
    return default


#: The kernel variants whose W4A8 multiplies int8 in dot-product instructions: ``vpdpbusd`` (and AMX-INT8 where the
#: CPU has it) in avx512vnni, ``vpmaddubsw``/``vpmaddwd`` in avx512 and avx2. The baseline variant (every non-x86
#: CPU too) sums int8 products in plain C++, slower than its float kernels.
INT8_DOT_VARIANTS = frozenset({"avx512vnni", "avx512", "avx2"})


def _kernel_features() -> set[str]:
    """``{"int8_dot"}`` where the loaded kernel variant is one of :data:`INT8_DOT_VARIANTS`; none for the baseline
    variant or without the compiled kernels."""
    native = _native.try_load()
    return {"int8_dot"} if native is not None and native.isa in INT8_DOT_VARIANTS else set()


def host_capabilities() -> DeviceCapabilities:
    """The capabilities of this machine's CPU, read from the OS (``int8_dot`` from the loaded kernel variant)."""
    from hal_core import DeviceCapabilities  # imported on first use: pydantic is slow to import

    info = _cpuinfo()
    machine = platform.machine().lower() or "unknown"
    flags = set((info.get("flags") or info.get("features") or "").split())
    suffix, lanes = _simd(machine, flags)
    cores = _cores()
    total, free = _memory()
    l1d, l2 = _cache_bytes(1, DEFAULT_L1D), _cache_bytes(2, DEFAULT_L2)
    name = info.get("model name") or platform.processor() or machine
    return DeviceCapabilities(
        vendor="cpu",
        name=name,
        arch=f"{machine}-{suffix}",
        compute_units=cores,
        simd_width=lanes,
        max_threads_per_block=MAX_THREADS_PER_BLOCK,
        max_threads_per_cu=MAX_THREADS_PER_CU,
        max_block_dims=MAX_BLOCK_DIMS,
        max_grid_dims=MAX_GRID_DIMS,
        shared_mem_per_block=l1d,
        shared_mem_per_block_optin=max(l1d, l2),
        shared_mem_per_cu=max(l1d, l2),
        registers_per_block=0,  # not meaningful on a CPU
        registers_per_cu=0,
        l2_bytes=l2,
        memory_total=total,
        memory_free=free,
        dtypes=frozenset({"fp64", "fp32", "fp16", "bf16", "int8", "int4"}),
        features=frozenset({"unified_memory", *_kernel_features()}),
        allocation_granularity=ALLOCATION_GRANULARITY,
    )


class CpuDevice(DeviceHandle):
    """The host: one device with asynchronous worker-thread streams."""

    def __init__(self, index: int = 0) -> None:
        self._index = index
        self._lock = threading.Lock()
        # the work queues of the streams, held weakly: a dropped stream is collected and its worker ends
        # once it has run what was queued (the running worker keeps its queue, so synchronize sees it)
        self._queues: weakref.WeakSet[_WorkQueue] = weakref.WeakSet()
        self._local = threading.local()

    @property
    def index(self) -> int:
        return self._index

    @cached_property
    def capabilities(self) -> DeviceCapabilities:
        return host_capabilities()

    @cached_property
    def default_stream(self) -> CpuStream:
        return self.create_stream()

    def current_stream(self) -> CpuStream:
        """The stream made current by ``with stream:`` on this thread, else the default stream."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default_stream

    def create_stream(self) -> CpuStream:
        stream = CpuStream(self)
        with self._lock:
            self._queues.add(stream._work)
        return stream

    def create_event(self, *, timing: bool = True) -> CpuEvent:
        return CpuEvent(self, timing=timing)

    def synchronize(self) -> None:
        """Wait for the work queued so far on every stream of this device, dropped streams included."""
        with self._lock:
            queues = list(self._queues)  # a snapshot: streams made meanwhile are not waited on
        for queue in queues:
            queue.synchronize()

    @cached_property
    def allocator(self) -> CpuAllocator:
        return CpuAllocator(granularity=self.capabilities.allocation_granularity, device=repr(self))

    @cached_property
    def launcher(self) -> CpuLauncher:
        return CpuLauncher(self)

    def _push_stream(self, stream: CpuStream) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)

    def _pop_stream(self, stream: CpuStream) -> None:
        stack = getattr(self._local, "stack", [])
        if stack and stack[-1] is stream:
            stack.pop()

    def __repr__(self) -> str:
        return f"<CpuDevice {self._index}>"
