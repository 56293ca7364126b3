"""CPU-specific behaviour: capabilities from the host, streams, allocator, launcher."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
from hal_cpu import CpuAllocator, CpuBackend, host_capabilities

import hal_core
from hal_core import DeviceOutOfMemoryError, KernelCompileError, KernelSource, LaunchConfig


@pytest.fixture(scope="module")
def device() -> Any:
    return hal_core.get_backend("cpu").device(0)


def test_selected_as_cpu_backend() -> None:
    """get_backend('cpu') binds this plugin's backend at priority 0."""
    backend = hal_core.get_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.priority == 0


def test_capabilities_come_from_the_host() -> None:
    """Cores, arch and memory reflect the machine."""
    caps = host_capabilities()
    assert caps.vendor == "cpu"
    assert caps.compute_units == len(os.sched_getaffinity(0))
    assert caps.arch.split("-")[0] in (os.uname().machine.lower(),)
    if caps.arch.endswith("avx512"):
        assert caps.simd_width == 16
    elif caps.arch.endswith(("avx2", "avx")):
        assert caps.simd_width == 8
    assert caps.memory_total > 0 and (caps.memory_free is None or caps.memory_free <= caps.memory_total)
    assert {"fp32", "fp16", "bf16", "int8", "int4"} <= caps.dtypes and caps.has("unified_memory")


def test_stream_runs_work_in_order_and_query_reflects_progress(device: Any) -> None:
    """Work queued behind a blocked item is pending; query and event become true only after it runs."""
    stream = device.create_stream()
    gate = threading.Event()
    order: list[int] = []
    stream.submit(gate.wait)
    stream.submit(lambda: order.append(1))
    event = stream.record_event()
    stream.submit(lambda: order.append(2))
    assert not stream.query() and not event.query()
    gate.set()
    stream.synchronize()
    assert order == [1, 2] and event.query()


def test_wait_event_blocks_the_waiting_stream_only(device: Any) -> None:
    """A stream waiting on another's event runs later work only after that event."""
    first, second = device.create_stream(), device.create_stream()
    gate = threading.Event()
    first.submit(gate.wait)
    marker = first.record_event()
    second.wait_event(marker)
    done = second.record_event()
    assert not done.query()
    gate.set()
    done.synchronize()
    assert marker.query()


def test_event_timing_measures_queued_work(device: Any) -> None:
    """elapsed_ms spans the work between the two events."""
    import time

    stream = device.create_stream()
    start = stream.record_event()
    stream.submit(lambda: time.sleep(0.02))
    end = stream.record_event()
    end.synchronize()
    assert start.elapsed_ms(end) >= 15.0
    with pytest.raises(RuntimeError, match="never recorded"):
        device.create_event().elapsed_ms(end)


def test_stream_reraises_work_errors_on_synchronize(device: Any) -> None:
    """An exception in queued work surfaces at the next synchronize, once."""
    stream = device.create_stream()

    def boom() -> None:
        raise ZeroDivisionError("kernel failed")

    stream.submit(boom)
    with pytest.raises(ZeroDivisionError):
        stream.synchronize()
    stream.synchronize()


def test_allocator_caches_by_size_class_and_counts() -> None:
    """Freed blocks are reused for the same size class; stats track in_use, peak, reserved, allocations."""
    allocator = CpuAllocator(granularity=64)
    a = allocator.allocate(100)
    assert a.ptr % 64 == 0
    stats = allocator.stats()
    assert (stats.in_use, stats.allocations, stats.reserved) == (128, 1, 128)
    ptr = a.ptr
    a.free()
    assert allocator.stats().in_use == 0 and allocator.stats().reserved == 128
    b = allocator.allocate(120)
    assert b.ptr == ptr, "same size class reuses the cached block"
    c = allocator.allocate(1000)
    assert allocator.stats().peak == 128 + 1024
    b.free()
    c.free()
    allocator.empty_cache()
    assert allocator.stats().reserved == 0


def test_allocator_limit_empties_cache_then_raises() -> None:
    """A limit first evicts cached blocks, then raises with requested/free/total."""
    allocator = CpuAllocator()
    allocator.allocate(4096).free()
    allocator.set_limit(8192)
    held = allocator.allocate(8192)  # fits only after the cached 4096 bytes are dropped
    with pytest.raises(DeviceOutOfMemoryError) as info:
        allocator.allocate(64)
    assert (info.value.requested, info.value.free, info.value.total) == (64, 0, 8192)
    held.free()


def test_buffer_view_bounds() -> None:
    """as_array refuses a view larger than the buffer, and any view after free."""
    buffer = CpuAllocator().allocate(16)
    assert buffer.as_array((4,), np.float32).shape == (4,)
    with pytest.raises(ValueError, match="needs 20 bytes"):
        buffer.as_array((5,), np.float32)
    buffer.free()
    with pytest.raises(ValueError, match="freed"):
        buffer.as_array((1,), np.uint8)


GRID_KERNEL = '''
import threading

def record(ctx, seen, names):
    seen[ctx.block_idx[2], ctx.block_idx[1], ctx.block_idx[0]] += 1
    names.add(threading.current_thread().name)
    assert ctx.shared.nbytes == 256 and ctx.threads_per_block == 64
'''


def test_launcher_runs_every_block_once_in_the_pool(device: Any) -> None:
    """Each block of a 3-D grid runs exactly once, on the launcher's thread pool."""
    kernel = device.launcher.load(KernelSource("grid.py", GRID_KERNEL, ("record",)))["record"]
    seen = np.zeros((3, 4, 5), dtype=np.int64)
    names: set[str] = set()
    device.launcher.launch(kernel, LaunchConfig(grid=(5, 4, 3), block=(64,), shared_mem=256), (seen, names))
    device.synchronize()
    assert (seen == 1).all()
    if device.capabilities.compute_units > 1:
        assert any(name.startswith("hal-cpu-block") for name in names)


def test_launcher_caches_and_reports_compile_errors(device: Any) -> None:
    """Loading twice hits the cache; bad source or a missing entry point raises KernelCompileError."""
    launcher = device.launcher
    source = KernelSource("grid.py", GRID_KERNEL, ("record",))
    before = launcher.cache_size()
    launcher.load(source)
    launcher.load(source)
    assert launcher.cache_size() <= before + 1
    with pytest.raises(KernelCompileError, match="SyntaxError"):
        launcher.load(KernelSource("bad.py", "def broken(:\n", ("broken",)))
    with pytest.raises(KernelCompileError, match="'missing'"):
        launcher.load(KernelSource("grid.py", GRID_KERNEL, ("missing",)))
    module_source = KernelSource("axpy", "hal_core.testing.kernels.axpy_host", ("hal_test_axpy",))
    assert "hal_test_axpy" in launcher.load(module_source)
