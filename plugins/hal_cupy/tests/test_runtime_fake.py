"""Allocator, launcher and stream logic over a fake CuPy (no GPU): OOM handling, compile cache, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cupy._launcher import CupyLauncher, kernel_arg
from hal_cupy._memory import CupyAllocator
from hal_cupy._stream import CupyStream, native_stream, stream_handle

import hal_core
from hal_core import AllocationPolicy, DeviceOutOfMemoryError, KernelCompileError, KernelSource, LaunchConfig

H100 = "NVIDIA H100 80GB HBM3"


def test_caching_allocator_counts_and_limits(fake_cupy: Any) -> None:
    """Statistics follow allocations and frees exactly; set_limit reaches the pool, rounded to 512 bytes."""
    alloc = CupyAllocator(0)
    assert alloc.policy is AllocationPolicy.CACHING and alloc.granularity == 512
    a = alloc.allocate(1000)
    b = alloc.allocate(24)
    stats = alloc.stats()
    assert (stats.in_use, stats.allocations, stats.limit) == (1024, 2, None)
    a.free()
    a.free()  # idempotent
    assert a.freed and a.ptr == 0 and alloc.stats().allocations == 1
    del b
    import gc

    gc.collect()
    assert alloc.stats().allocations == 0
    alloc.set_limit(1000)
    assert alloc.pool.limit == 1024
    alloc.set_limit(None)
    assert alloc.pool.limit == 0


def test_oom_frees_cache_retries_once_then_raises(fake_cupy: Any) -> None:
    """A failing malloc frees cached blocks (its pool's and CuPy's default pool's) and retries once;
    a second failure is DeviceOutOfMemoryError."""
    alloc = CupyAllocator(0, name="cuda:0 (fake)")
    alloc.pool.fail_next = 1
    assert alloc.allocate(4096).nbytes == 4096
    assert alloc.pool.freed_all == 1 and fake_cupy.default_pool.freed_all == 1
    alloc.pool.fail_next = 2
    with pytest.raises(DeviceOutOfMemoryError) as info:
        alloc.allocate(1 << 20)
    err = info.value
    assert (err.requested, err.total) == (1 << 20, fake_cupy.gpu.total) and err.free >= 0
    assert "cuda:0 (fake)" in str(err) and isinstance(err, MemoryError)
    assert alloc.pool.freed_all == 2


def test_managed_never_asks_more_than_free(fake_cupy: Any) -> None:
    """Managed memory up to the free bytes; a larger request uses device memory (and then fails loudly)."""
    alloc = CupyAllocator(0, AllocationPolicy.MANAGED)
    alloc.allocate(1 << 20)
    assert fake_cupy.gpu.allocations[-1] == ("managed", 1 << 20)
    too_big = fake_cupy.gpu.free + 1
    with pytest.raises(DeviceOutOfMemoryError):
        alloc.allocate(too_big)
    assert too_big not in fake_cupy.gpu.managed_requests


def test_managed_falls_back_when_it_fails(fake_cupy: Any) -> None:
    """A failing managed allocation falls back to device memory."""
    fake_cupy.gpu.managed_fails = True
    alloc = CupyAllocator(0, AllocationPolicy.MANAGED)
    alloc.allocate(4096)
    assert fake_cupy.gpu.allocations[-1] == ("device", 4096)


def test_managed_unsupported_uses_device_memory(fake_cupy: Any) -> None:
    """No managed memory on the device: device memory, no managed request at all."""
    alloc = CupyAllocator(0, AllocationPolicy.MANAGED, managed_supported=False)
    alloc.allocate(4096)
    assert fake_cupy.gpu.managed_requests == [] and fake_cupy.gpu.allocations[-1][0] == "device"


def test_async_without_pool_support_is_caching(fake_cupy: Any) -> None:
    """Asking for the async policy where memory pools are unsupported gives the caching pool."""
    assert CupyAllocator(0, "async", async_supported=False).policy is AllocationPolicy.CACHING
    assert CupyAllocator(0, "async").policy is AllocationPolicy.ASYNC


def test_async_limit_is_the_shared_release_threshold(fake_cupy: Any) -> None:
    """The async pool's "no limit" (UINT64_MAX) reads as None; set_limit sets the process-wide release
    threshold and set_limit(None) restores the value the pool was made with, not UINT64_MAX blindly."""
    import fakecupy

    alloc = CupyAllocator(0, "async")
    assert alloc.stats().limit is None and alloc.pool.get_limit() == fakecupy.UINT64_MAX
    alloc.set_limit(1000)
    assert alloc.stats().limit == 1024 and fake_cupy.mempool.threshold == 1024
    other = CupyAllocator(0, "async")
    other.set_limit(2048)
    assert alloc.stats().limit == 2048  # one threshold for the process
    other.allocate(512)
    assert alloc.stats().in_use == 512  # pool-wide bytes: the other allocator's count here too
    alloc.set_limit(None)
    assert other.stats().limit is None and fake_cupy.mempool.threshold == fakecupy.UINT64_MAX


def test_async_limit_restores_the_environment_value(fake_cupy: Any) -> None:
    """With CUPY_GPU_MEMORY_LIMIT set when the pool is made, set_limit(None) goes back to it."""
    fake_cupy.env_limit = 1 << 30
    alloc = CupyAllocator(0, "async")
    assert alloc.stats().limit == 1 << 30
    alloc.set_limit(4096)
    assert alloc.stats().limit == 4096
    with pytest.raises(DeviceOutOfMemoryError):
        alloc.allocate(8192)
    alloc.set_limit(None)
    assert alloc.stats().limit == 1 << 30
    assert alloc.allocate(8192).nbytes == 8192


def test_host_policy_refused(fake_cupy: Any) -> None:
    with pytest.raises(ValueError, match="host"):
        CupyAllocator(0, AllocationPolicy.HOST)


def _source(code: str = "extern \"C\" __global__ void k() {}", options: tuple[str, ...] = ()) -> KernelSource:
    return KernelSource("k.cu", code, ("k",), options)


def test_launcher_compiles_once_per_digest(fake_cupy: Any) -> None:
    """load() compiles on first use and caches by (digest with options, arch)."""
    launcher = CupyLauncher(0, hal_core.load_profile(H100), fmad=True)
    first = launcher.load(_source())
    again = launcher.load(_source())
    assert first["k"] is again["k"] and len(fake_cupy.RawModule.compiled) == 1
    launcher.load(_source(options=("-DX=1",)))
    assert len(fake_cupy.RawModule.compiled) == 2
    assert launcher.cache_key(_source())[1] == "sm_90"


def test_fmad_off_is_an_option_and_a_cache_key(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_CUDA_FMAD=0 adds -fmad=false and a distinct cache entry."""
    from hal_cuda import CUDA

    launcher = CupyLauncher(0, hal_core.load_profile(H100), platform=CUDA)
    key_on = launcher.cache_key(_source())
    monkeypatch.setenv("HAL_CUDA_FMAD", "0")
    assert launcher.compile_options(_source()) == ("-fmad=false",)
    assert launcher.cache_key(_source()) != key_on
    launcher.load(_source())
    assert fake_cupy.RawModule.compiled[-1][1] == ("-fmad=false",)


@pytest.mark.parametrize(("profile", "compiled_for"), [("H100", 64), ("RX 7900 XTX", 64), ("MI300X", 32)])
def test_launch_refused_on_another_simd_width(fake_cupy: Any, profile: str, compiled_for: int) -> None:
    """A kernel specialised for one SIMD width is never launched on a device of another (columns would drop)."""
    caps = hal_core.load_profile(profile)
    launcher = CupyLauncher(0, caps)
    kernel = launcher.load(_source(options=(f"-DHAL_WARP_SIZE={compiled_for}",)))["k"]
    assert kernel.simd_width == compiled_for
    with pytest.raises(hal_core.LaunchConfigError, match=f"SIMD width of {compiled_for} lanes"):
        launcher.launch(kernel, LaunchConfig(grid=(1,), block=(128,)), [])
    assert kernel.raw.calls == []
    matching = launcher.load(_source(options=(f"-DHAL_WARP_SIZE={caps.simd_width}",)))["k"]
    launcher.launch(matching, LaunchConfig(grid=(1,), block=(128,)), [])
    assert len(matching.raw.calls) == 1


def test_compile_error_carries_the_log(fake_cupy: Any) -> None:
    """An NVRTC failure becomes KernelCompileError with the compiler's log."""
    fake_cupy.RawModule.fail_with = 'k.cu(3): error: identifier "oops" is undefined'
    launcher = CupyLauncher(0, hal_core.load_profile(H100))
    with pytest.raises(KernelCompileError) as info:
        launcher.load(_source(options=("-DA=1",)))
    assert "oops" in info.value.log and "-DA=1" in info.value.options


def test_missing_entry_point_is_a_compile_error(fake_cupy: Any) -> None:
    launcher = CupyLauncher(0, hal_core.load_profile(H100))
    with pytest.raises(KernelCompileError, match="named symbol not found"):
        launcher.load(KernelSource("k.cu", "x", ("missing_kernel",)))


def test_launch_validates_and_opts_into_large_shared_memory(fake_cupy: Any) -> None:
    """Launch configs are checked against the device; > 48 KiB dynamic shared memory sets the kernel attribute."""
    launcher = CupyLauncher(0, hal_core.load_profile(H100))
    kernel = launcher.load(_source())["k"]
    launcher.launch(kernel, LaunchConfig(grid=(2,), block=(128,), shared_mem=100_000), [np.int32(3)])
    assert kernel.raw.max_dynamic_shared_size_bytes == 100_000
    grid, block, _args, shared = kernel.raw.calls[-1]
    assert (grid, block, shared) == ((2, 1, 1), (128, 1, 1), 100_000)
    with pytest.raises(hal_core.LaunchConfigError, match="max_threads_per_block"):
        launcher.launch(kernel, LaunchConfig(grid=(1,), block=(2048,)), [])
    with pytest.raises(hal_core.LaunchConfigError, match="shared"):
        launcher.launch(kernel, LaunchConfig(grid=(1,), block=(32,), shared_mem=300_000), [])


def test_grid_stride_config_uses_occupancy(fake_cupy: Any) -> None:
    """config_for: grid = min(blocks needed, SMs x occupancy), block a multiple of the warp."""
    caps = hal_core.load_profile(H100)
    launcher = CupyLauncher(0, caps)
    kernel = launcher.load(_source())["k"]
    fake_cupy.occupancy = 3
    config = launcher.config_for(kernel, 10**9, threads_per_block=256)
    assert config.grid == (caps.compute_units * 3, 1, 1) and config.block == (256, 1, 1)
    assert launcher.config_for(kernel, 1000, threads_per_block=256).grid == (4, 1, 1)


def test_kernel_args() -> None:
    """None is a null pointer, floats become float32, bare ints are refused."""
    assert kernel_arg(None) == np.uint64(0)
    assert kernel_arg(0.5).dtype == np.float32
    with pytest.raises(TypeError, match=r"np\.int32"):
        kernel_arg(3)
    tagged = hal_core.arrays.TaggedArray(np.zeros(2, np.uint16), "bf16")
    assert kernel_arg(tagged) is tagged.storage


class TorchLikeStream:
    """Exposes the CUDA stream protocol the way CUDA Python and torch do."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0xABC0)


def test_foreign_streams_are_wrapped(fake_cupy: Any) -> None:
    """Any object with __cuda_stream__ becomes a hal stream on the same handle."""
    assert stream_handle(TorchLikeStream()) == 0xABC0
    wrapped = CupyStream.wrap(TorchLikeStream(), 0)
    assert wrapped.ptr == 0xABC0
    assert native_stream(wrapped, 0) is wrapped.native
    with pytest.raises(TypeError, match="__cuda_stream__"):
        native_stream(object(), 0)


def test_foreign_streams_without_from_external(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy 13 has no Stream.from_external: the handle goes through ExternalStream, with the device."""
    monkeypatch.setattr(fake_cupy.cuda.Stream, "from_external", None, raising=False)
    native = native_stream(TorchLikeStream(), 1)
    assert (native.ptr, native.device_id) == (0xABC0, 1)


class AttributeStream:
    """Older producers expose the tuple as an attribute."""

    __cuda_stream__ = (0, 77)


def test_stream_protocol_attribute_form() -> None:
    assert stream_handle(AttributeStream()) == 77


@pytest.mark.parametrize("producer", [TorchLikeStream(), AttributeStream()], ids=["method", "attribute"])
def test_foreign_stream_takes_the_given_device(fake_cupy: Any, producer: Any) -> None:
    """Stream.from_external records the current device: the wrap makes device_index current for it,
    whichever form of __cuda_stream__ the producer has; the CuPy stream keeps the producer alive."""
    native = CupyStream.wrap(producer, 1).native
    assert (native.ptr, native.device_id) == (stream_handle(producer), 1)
    assert native.foreign.producer is producer
    assert fake_cupy.devices == [0]  # the current device is restored
