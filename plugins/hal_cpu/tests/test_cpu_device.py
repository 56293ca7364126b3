"""CPU-specific behaviour: capabilities from the host, streams, allocator, launcher."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
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
    """A stream waiting on another's event runs later work only after that event.

    The first stream is blocked by a gate that opens only once the second
    stream's worker has reached the wait, so work after a wait that does
    nothing would run (and log) while the first stream is still blocked.
    """
    first, second = device.create_stream(), device.create_stream()
    gate, reached = threading.Event(), threading.Event()
    log: list[str] = []
    first.submit(gate.wait)
    first.submit(lambda: log.append("first"))
    marker = first.record_event()
    second.submit(reached.set)
    second.wait_event(marker)
    second.submit(lambda: log.append("second"))
    done = second.record_event()
    reached.wait()
    assert not done.query() and not marker.query()
    other = device.create_stream()  # streams that do not wait are not held up
    other.submit(lambda: log.append("other"))
    other.synchronize()
    gate.set()
    done.synchronize()
    assert marker.query()
    assert log == ["other", "first", "second"]


def test_wait_event_orders_launches_across_streams(device: Any) -> None:
    """A launch queued after wait_event sees what a gated launch on the other stream wrote."""
    kernel = device.launcher.load(KernelSource("gate.py", GATE_KERNEL, ("gated_fill", "copy")))
    first, second = device.create_stream(), device.create_stream()
    gate = threading.Event()
    src, dst = np.zeros(8, np.float32), np.zeros(8, np.float32)
    config = LaunchConfig(grid=(1,), block=(8,))
    device.launcher.launch(kernel["gated_fill"], config, (gate, src, np.float32(3.0)), first)
    second.wait_event(first.record_event())
    device.launcher.launch(kernel["copy"], config, (src, dst), second)
    done = second.record_event()
    assert not done.query()
    gate.set()
    done.synchronize()
    np.testing.assert_array_equal(dst, 3.0)


GATE_KERNEL = '''
def gated_fill(ctx, gate, out, value):
    gate.wait()
    out[ctx.global_ids] = value

def copy(ctx, src, dst):
    dst[ctx.global_ids] = src[ctx.global_ids]
'''


def test_event_timing_measures_queued_work(device: Any) -> None:
    """elapsed_ms spans the work between the two events: the end is stamped after the gated work ran.

    An ordering check, not a timed one: the start event completed before the
    host read ``after_start``, and the end event runs after ``gate.set()``, so
    ``elapsed_ms`` is at least the host's time between the two, whatever it is.
    """
    stream = device.create_stream()
    gate = threading.Event()
    start = stream.record_event()
    stream.submit(gate.wait)
    end = stream.record_event()
    start.synchronize()
    after_start = time.perf_counter_ns()
    assert not end.query(), "the end event waits for the gated work"
    before_set = time.perf_counter_ns()
    gate.set()
    end.synchronize()
    assert start.elapsed_ms(end) >= (before_set - after_start) / 1e6
    with pytest.raises(RuntimeError, match="never recorded"):
        device.create_event().elapsed_ms(end)


def test_dropped_streams_are_released_with_their_workers(device: Any) -> None:
    """The device holds its streams weakly: a dropped stream is collected and its worker thread ends."""
    streams = [device.create_stream() for _ in range(3)]
    for stream in streams:
        stream.submit(lambda: None)
    device.synchronize()
    refs = [weakref.ref(stream) for stream in streams]
    workers = [stream._work.thread for stream in streams]
    queues = [weakref.ref(stream._work) for stream in streams]
    assert all(q() in device._queues for q in queues)
    del streams, stream
    gc.collect()
    assert all(ref() is None for ref in refs), "the device must not keep dropped streams alive"
    for worker in workers:
        worker.join()  # returns once the closed queue's worker has exited (it would hang before the fix)
    gc.collect()
    # Only this test's queues are checked: streams of earlier tests may be collected meanwhile.
    assert all(q() is None for q in queues), "the device must release a dropped stream's work queue"


def test_device_synchronize_waits_for_dropped_streams_work(device: Any) -> None:
    """Work queued on a stream that was then dropped still runs, and device.synchronize waits for it."""
    gate = threading.Event()
    ran: list[int] = []
    stream = device.create_stream()
    stream.submit(gate.wait)
    stream.submit(lambda: ran.append(1))
    del stream
    gc.collect()
    assert not ran
    gate.set()
    device.synchronize()
    assert ran == [1]


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


def test_buffer_views_keep_the_buffer_alive() -> None:
    """A view outlives its dropped buffer: its block is not handed out again while the view lives."""
    allocator = CpuAllocator()
    buffer = allocator.allocate(256)
    view = buffer.as_array((64,), np.float32)
    view[...] = 1.0
    del buffer
    gc.collect()
    assert allocator.stats().in_use == 256, "the view's block is still in use"
    other = allocator.allocate(256)  # same size class: would reuse a released block
    fresh = other.as_array((64,), np.float32)
    assert not np.shares_memory(view, fresh)
    fresh[...] = 2.0
    assert (view == 1.0).all()
    del view
    gc.collect()
    assert allocator.stats().in_use == 256, "the last view gone, its buffer returned to the allocator"
    other.free()


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
