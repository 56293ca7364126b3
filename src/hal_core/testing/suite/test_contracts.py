"""Contract behaviour every backend must show: devices, capabilities, streams, events, memory, launcher."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import DeviceCapabilities, DeviceOutOfMemoryError, LaunchConfig, LaunchConfigError


def test_backend_identity(hal_backend: Any) -> None:
    """The backend has a name, an integer priority, is available, and lists its devices by index."""
    assert isinstance(hal_backend.name, str) and hal_backend.name
    assert isinstance(hal_backend.priority, int)
    assert hal_backend.availability().ok
    devices = list(hal_backend.devices())
    assert devices, "a backend lists at least one device"
    for i, device in enumerate(devices):
        assert device.index == i
        assert hal_backend.device(i) is device
    with pytest.raises(IndexError):
        hal_backend.device(len(devices))


def test_backend_array_round_trip(hal_backend: Any, hal_arrays: Any, hal_rng: np.random.Generator) -> None:
    """asarray puts an array in the backend's domain, owns() says so, to_numpy reads it back equal."""
    host = hal_rng.standard_normal((3, 5)).astype(np.float32)
    array = hal_arrays.asarray(host)
    assert hal_backend.owns(array)
    np.testing.assert_array_equal(hal_arrays.to_numpy(array), host)
    assert not hal_arrays.to_numpy(hal_arrays.zeros((2, 2), np.float16)).any()


def test_capabilities_json_round_trip(hal_device: Any) -> None:
    """Capabilities are valid, serialise to JSON and parse back equal."""
    caps = hal_device.capabilities
    assert isinstance(caps, DeviceCapabilities)
    text = caps.to_json()
    json.loads(text)
    assert DeviceCapabilities.from_json(text) == caps
    assert caps.supports_dtype("fp32")
    assert caps.max_threads_per_block >= caps.simd_width
    assert caps.memory_total > 0


def test_stream_event_ordering_and_timing(hal_device: Any) -> None:
    """Events recorded on a stream complete, time monotonically, and sync the host."""
    stream = hal_device.create_stream()
    start = stream.record_event()
    end = hal_device.create_event()
    end.record(stream)
    end.synchronize()
    assert start.query() and end.query()
    assert stream.query()
    elapsed = start.elapsed_ms(end)
    assert math.isfinite(elapsed) and elapsed >= 0.0
    stream.synchronize()
    hal_device.synchronize()


def test_stream_wait_event_across_streams(hal_device: Any, hal_backend: Any, hal_axpy_source: Any) -> None:
    """wait_event orders a second stream after an event of the first, which is still busy when it is called.

    The first stream gets a backlog of axpy launches (``acc += 1``, sized by
    the device's resident threads so it outlasts the host's enqueueing); the
    second waits on an event recorded after them, then copies ``acc`` with one
    more launch. Only if the wait holds does the copy see every increment.
    The contract offers no way to block a stream at will, so a wait_event
    that does nothing is caught only while the backlog lasts (the CPU
    plugin's own tests block its stream with a gate for that).
    """
    caps = hal_device.capabilities
    launcher = hal_device.launcher
    kernel = launcher.load(hal_axpy_source)["hal_test_axpy"]
    n = min(1 << 24, 64 * caps.compute_units * caps.max_threads_per_cu)
    launches = 32
    ones = hal_backend.asarray(np.ones(n, np.float32))
    acc = hal_backend.asarray(np.zeros(n, np.float32))
    copy = hal_backend.asarray(np.zeros(n, np.float32))
    config = launcher.config_for(kernel, n)
    first, second = hal_device.create_stream(), hal_device.create_stream()
    for _ in range(launches):
        launcher.launch(kernel, config, (ones, acc, np.float32(1.0), np.int32(n)), first)
    event = first.record_event()
    second.wait_event(event)
    launcher.launch(kernel, config, (acc, copy, np.float32(1.0), np.int32(n)), second)
    after = second.record_event()
    after.synchronize()
    assert event.query(), "an event waited on has completed before later work of the waiting stream"
    assert after.query() and second.query()
    first.synchronize()
    got = hal_backend.to_numpy(copy)
    assert (got == launches).all(), (
        f"work after wait_event ran before the awaited work: it saw acc = {got.min():g}, expected {launches}"
    )


def test_default_stream_and_event_default_record(hal_device: Any) -> None:
    """record() with no stream records on the default stream."""
    event = hal_device.create_event(timing=False)
    event.record()
    event.synchronize()
    assert event.query()
    hal_device.default_stream.synchronize()


def test_allocator_allocate_free_stats(hal_device: Any) -> None:
    """Allocation raises in_use by at least the size; free is idempotent and returns it."""
    allocator = hal_device.allocator
    before = allocator.stats()
    nbytes = 10_000
    buffer = allocator.allocate(nbytes)
    assert buffer.nbytes >= nbytes and buffer.ptr != 0 and not buffer.freed
    during = allocator.stats()
    assert during.in_use >= before.in_use + nbytes
    assert during.peak >= during.in_use and during.reserved >= during.in_use
    buffer.free()
    buffer.free()
    assert buffer.freed and buffer.ptr == 0
    assert allocator.stats().in_use == before.in_use
    assert allocator.round_up(1) % allocator.granularity == 0


def test_allocator_context_manager_and_view(hal_device: Any, hal_backend: Any) -> None:
    """A buffer frees itself on context exit; as_array views it as the backend's array."""
    allocator = hal_device.allocator
    before = allocator.stats().in_use
    with allocator.allocate(64 * 4) as buffer:
        view = buffer.as_array((8, 8), np.float32)
        view[...] = hal_backend.asarray(np.arange(64, dtype=np.float32).reshape(8, 8))
        np.testing.assert_array_equal(hal_backend.to_numpy(view).ravel(), np.arange(64))
        assert allocator.stats().in_use > before
    assert buffer.freed
    assert allocator.stats().in_use == before


def test_allocator_limit_raises_with_byte_counts(hal_device: Any) -> None:
    """Beyond set_limit, allocate raises DeviceOutOfMemoryError carrying the requested bytes."""
    allocator = hal_device.allocator
    try:
        allocator.set_limit(allocator.stats().in_use + 4096)
    except NotImplementedError:
        pytest.skip("this allocator supports no limit")
    try:
        with pytest.raises(DeviceOutOfMemoryError) as info:
            allocator.allocate(1 << 20)
        assert info.value.requested == 1 << 20
        assert isinstance(info.value, MemoryError)
    finally:
        allocator.set_limit(None)


def test_launcher_load_and_launch(hal_device: Any, hal_backend: Any, hal_axpy_source: Any,
                                  hal_rng: np.random.Generator) -> None:
    """A kernel loads (cached), launches over a multi-block grid, and computes y += a * x."""
    launcher = hal_device.launcher
    kernels = launcher.load(hal_axpy_source)
    kernel = kernels["hal_test_axpy"]
    assert launcher.load(hal_axpy_source)["hal_test_axpy"].name == kernel.name
    n = 5000
    x_host = hal_rng.standard_normal(n).astype(np.float32)
    y_host = hal_rng.standard_normal(n).astype(np.float32)
    expected = y_host + 2.0 * x_host
    x, y = hal_backend.asarray(x_host), hal_backend.asarray(y_host.copy())
    config = LaunchConfig(grid=(7,), block=(128,))
    stream = hal_device.create_stream()
    launcher.launch(kernel, config, (x, y, np.float32(2.0), np.int32(n)), stream)
    stream.synchronize()
    np.testing.assert_allclose(hal_backend.to_numpy(y), expected, rtol=1e-6, atol=1e-6)


def test_launcher_rejects_config_beyond_limits(hal_device: Any, hal_backend: Any, hal_axpy_source: Any) -> None:
    """A launch beyond a device limit raises LaunchConfigError naming the limit, and runs nothing."""
    caps = hal_device.capabilities
    launcher = hal_device.launcher
    kernel = launcher.load(hal_axpy_source)["hal_test_axpy"]
    y = hal_backend.asarray(np.zeros(16, np.float32))
    args = (hal_backend.asarray(np.ones(16, np.float32)), y, np.float32(1.0), np.int32(16))
    too_many_threads = LaunchConfig(grid=(1,), block=(caps.max_threads_per_block + 1,))
    with pytest.raises(LaunchConfigError, match="max_threads_per_block"):
        launcher.launch(kernel, too_many_threads, args)
    too_big_grid = LaunchConfig(grid=(1, caps.max_grid_dims[1] + 1), block=(1,))
    with pytest.raises(LaunchConfigError, match=r"max_grid_dims\[1\]"):
        launcher.launch(kernel, too_big_grid, args)
    hal_device.synchronize()
    assert not hal_backend.to_numpy(y).any(), "a rejected launch must not run"


def test_launcher_config_for(hal_device: Any, hal_axpy_source: Any) -> None:
    """config_for derives a valid 1-D config from the device: SIMD-multiple blocks, grid covering the work."""
    caps = hal_device.capabilities
    launcher = hal_device.launcher
    kernel = launcher.load(hal_axpy_source)["hal_test_axpy"]
    for work in (1, 1000, 10**7):
        config = launcher.config_for(kernel, work)
        config.validate(caps)
        assert config.threads_per_block % caps.simd_width == 0
        covered = config.num_blocks * config.threads_per_block
        assert covered >= work or config.grid[0] >= caps.compute_units


def test_get_backend_by_name(hal_backend: Any) -> None:
    """get_backend(name) returns the same bound backend."""
    assert hal_core.get_backend(hal_backend.name) is hal_backend
