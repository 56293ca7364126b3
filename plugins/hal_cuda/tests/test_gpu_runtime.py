"""The runtime contracts on a real GPU: devices, streams, events, allocators, launcher, array exchange.

Skipped (lazily, with the probe's reason) where no CUDA device is usable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cupy._memory import CupyAllocator

import hal_core
from hal_core import AllocationPolicy, DeviceOutOfMemoryError, KernelCompileError, KernelSource, LaunchConfig
from hal_core.arrays import BFLOAT16, TaggedArray


def test_devices_and_capabilities(cuda_backend: Any, cupy_module: Any) -> None:
    """One handle per visible GPU; capabilities read from the device match CuPy's own view."""
    devices = cuda_backend.devices()
    assert len(devices) == cupy_module.cuda.runtime.getDeviceCount()
    caps = devices[0].capabilities
    major, minor = cupy_module.cuda.Device(0).compute_capability[:-1], cupy_module.cuda.Device(0).compute_capability[-1]
    assert caps.arch == f"sm_{major}{minor}" and caps.vendor == "nvidia" and caps.simd_width == 32
    assert caps.compute_units > 0 and 0 < caps.memory_free <= caps.memory_total
    assert hal_core.DeviceCapabilities.from_json(caps.to_json()) == caps


def test_stream_event_timing(cuda_backend: Any, cupy_module: Any) -> None:
    """Events time work on a stream; wait_event orders a second stream after it."""
    dev = cuda_backend.device(0)
    s1, s2 = dev.create_stream(), dev.create_stream()
    start, end = dev.create_event(), dev.create_event()
    x = cupy_module.ones(1 << 24, dtype=np.float32)
    start.record(s1)
    with s1:
        y = x * 2
    end.record(s1)
    s2.wait_event(end)
    with s2:
        z = y + 1
    s2.synchronize()
    assert end.query() and start.elapsed_ms(end) >= 0
    assert float(z[-1]) == 3.0 and s1.query()


def test_foreign_stream(cuda_backend: Any, cupy_module: Any) -> None:
    """An object exposing __cuda_stream__ is wrapped on the same handle, and ops run on it."""
    native = cupy_module.cuda.Stream(non_blocking=True)

    class Foreign:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, native.ptr)

    wrapped = cuda_backend.device(0).wrap_stream(Foreign())
    assert wrapped.ptr == native.ptr
    event = wrapped.record_event()
    event.synchronize()


def test_caching_allocator(cuda_backend: Any) -> None:
    """Buffers come from CuPy's pool; stats move; arrays view them without a copy."""
    alloc = cuda_backend.device(0).allocator
    assert alloc.policy is AllocationPolicy.CACHING
    before = alloc.stats()
    with alloc.allocate(1 << 20) as buf:
        arr = buf.as_array((1 << 18,), np.float32)
        arr[...] = 1.5
        assert arr.data.ptr == buf.ptr
        assert alloc.stats().in_use >= before.in_use + (1 << 20)
        tagged = buf.as_array((16,), BFLOAT16)
        assert isinstance(tagged, TaggedArray) and tagged.hal_dtype == "bf16"
    assert buf.freed


def test_out_of_memory_is_loud(cuda_backend: Any) -> None:
    """More than the device has: DeviceOutOfMemoryError with byte counts, no CPU fallback."""
    dev = cuda_backend.device(0)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        dev.allocator.allocate(dev.capabilities.memory_total * 2)
    assert info.value.requested == dev.capabilities.memory_total * 2 and info.value.total > 0


def test_limit(cuda_backend: Any) -> None:
    """set_limit caps the pool; a request above it fails loudly."""
    alloc = CupyAllocator(0, AllocationPolicy.ASYNC)
    alloc.set_limit(64 << 20)
    try:
        with pytest.raises(DeviceOutOfMemoryError):
            alloc.allocate(128 << 20)
        assert alloc.allocate(1 << 20).nbytes == 1 << 20
        assert alloc.stats().limit == 64 << 20
    finally:
        alloc.set_limit(None)


def test_managed_allocator(cuda_backend: Any) -> None:
    """Managed allocations work (or fall back to device memory) and are usable from kernels."""
    alloc = CupyAllocator(0, AllocationPolicy.MANAGED)
    buf = alloc.allocate(1 << 20)
    arr = buf.as_array((1 << 18,), np.float32)
    arr[...] = 2.0
    assert float(arr.sum()) == 2.0 * (1 << 18)
    buf.free()


def test_compile_error_has_nvrtc_log(cuda_backend: Any) -> None:
    launcher = cuda_backend.device(0).launcher
    bad = KernelSource("bad.cu", 'extern "C" __global__ void k() { undefined_name; }', ("k",))
    with pytest.raises(KernelCompileError) as info:
        launcher.load(bad)
    assert "undefined_name" in info.value.log


def test_launch_and_occupancy_grid(cuda_backend: Any, cupy_module: Any) -> None:
    """A grid-stride kernel launched with an occupancy-derived grid fills an array."""
    launcher = cuda_backend.device(0).launcher
    src = KernelSource("fill.cu", 'extern "C" __global__ void fill(float* p, long long n) {'
                       ' for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;'
                       ' i += (long long)gridDim.x * blockDim.x) p[i] = (float)i; }', ("fill",))
    kernel = launcher.load(src)["fill"]
    assert kernel.attributes["max_threads_per_block"] >= 256
    n = 10_000_000
    out = cupy_module.empty(n, dtype=np.float32)
    config = launcher.config_for(kernel, n, threads_per_block=256)
    assert config.grid[0] <= launcher.capabilities.compute_units * launcher.blocks_per_cu(kernel, 256)
    launcher.launch(kernel, config, (out, np.int64(n)))
    assert float(out[n - 1]) == float(np.float32(n - 1))
    with pytest.raises(hal_core.LaunchConfigError):
        launcher.launch(kernel, LaunchConfig(grid=(1,), block=(4096,)), (out, np.int64(n)))


def test_bf16_round_trip(cuda_backend: Any, rng: np.random.Generator) -> None:
    """bf16 numpy -> TaggedArray(uint16 CuPy) -> numpy keeps every bit."""
    x = rng.standard_normal((7, 5)).astype(BFLOAT16)
    dev = cuda_backend.asarray(x)
    assert isinstance(dev, TaggedArray) and str(dev.storage.dtype) == "uint16"
    back = cuda_backend.to_numpy(dev)
    assert back.dtype == BFLOAT16 and np.array_equal(back.view(np.uint16), x.view(np.uint16))


def test_cuda_array_interface_inputs_without_copy(cuda_backend: Any, cupy_module: Any,
                                                  rng: np.random.Generator) -> None:
    """A foreign array (torch-like: __cuda_array_interface__ plus a DLPack device) is used in place."""
    class Foreign:
        def __init__(self, array: Any) -> None:
            self._array = array
            self.__cuda_array_interface__ = array.__cuda_array_interface__
            self.shape, self.dtype, self.flags = array.shape, array.dtype, array.flags

        def __dlpack_device__(self) -> tuple[int, int]:
            return self._array.__dlpack_device__()

    key = rng.standard_normal((3, 2, 64)).astype(np.float16)
    cache = cupy_module.zeros((2, 2, 16, 64), dtype=np.float16)
    vcache = cupy_module.zeros_like(cache)
    foreign = Foreign(cache)
    assert cuda_backend.owns(foreign)
    cuda_backend.ops.write_kv_cache(cuda_backend.asarray(key), cuda_backend.asarray(key), foreign, vcache,
                                    cupy_module.asarray(np.array([0, 17, 5], np.int64)))
    np.testing.assert_array_equal(cache[0, :, 0].get(), key[0])
    np.testing.assert_array_equal(cache[1, :, 1].get(), key[1])


def test_zero_size_launches_nothing(cuda_backend: Any, cupy_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty work is answered by the dispatcher without a kernel launch."""
    launches: list[Any] = []
    launcher = cuda_backend.device(0).launcher
    monkeypatch.setattr(type(launcher), "_launch", lambda self, *a: launches.append(a))
    q = cupy_module.zeros((0, 4, 64), dtype=np.float16)
    kc = cupy_module.zeros((1, 4, 16, 64), dtype=np.float16)
    out = cuda_backend.ops.paged_attention(q, kc, kc, cupy_module.zeros((0, 1), np.int32),
                                           cupy_module.zeros((0,), np.int32), scale=0.1)
    assert out.shape == (0, 4, 64) and launches == []
