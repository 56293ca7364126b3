"""Kernel compilation and launch over ``cupy.RawModule`` (NVRTC or HIPRTC, with CuPy's disk cache).

A :class:`~hal_core.KernelSource` compiles on first use for the device's
own architecture (CuPy passes the current device's ``sm_XY`` or ``gfxNNN``
and writes the binary to its disk cache, ``~/.cupy/kernel_cache``). Compiled
modules are also kept in memory per launcher, keyed by (source digest
including the options, arch). The platform adds its own options;
``HAL_<BACKEND>_FMAD=0`` (or ``fmad=False``) asks it for no multiply-add
contraction, for bit-reproducible results.

A kernel compiled for one SIMD width (``-DHAL_WARP_SIZE=N``) is refused at
launch on a device of another: its lane layout would silently drop columns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hal_core import (
    CompiledKernel,
    KernelCompileError,
    KernelLauncher,
    KernelSource,
    LaunchConfig,
    LaunchConfigError,
    grid_for,
)
from hal_core.arrays import untag

from . import _env
from ._cupy import cupy
from ._platform import GpuPlatform
from ._stream import native_stream

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["CupyKernel", "CupyLauncher", "compiled_simd_width", "kernel_arg"]

_WARP_DEFINE = "-DHAL_WARP_SIZE="


def compiled_simd_width(options: Sequence[str]) -> int | None:
    """The SIMD width a source is specialised for (its ``-DHAL_WARP_SIZE=N`` option), None when not specialised."""
    for option in options:
        if option.startswith(_WARP_DEFINE):
            return int(option[len(_WARP_DEFINE):])
    return None


def kernel_arg(value: Any) -> Any:
    """A value RawKernel can pass: arrays as they are (TaggedArray as its storage), Python numbers typed.

    ``None`` becomes a null pointer. Python ints must be wrapped by the caller
    in the C type the kernel expects (``np.int32``/``np.int64``); a bare int is
    refused rather than guessed.
    """
    if value is None:
        return np.uint64(0)
    value = untag(value)
    if isinstance(value, bool) or (isinstance(value, int) and not isinstance(value, np.integer)):
        raise TypeError(f"pass kernel integers as np.int32/np.int64, got int {value!r}")
    if isinstance(value, float):
        return np.float32(value)
    return value


class CupyKernel(CompiledKernel):
    """One entry point of a compiled ``cupy.RawModule``."""

    def __init__(self, name: str, raw: Any, source_name: str = "", simd_width: int | None = None) -> None:
        self.name = name
        self.raw = raw
        self.source_name = source_name
        #: The SIMD width the kernel was compiled for (None: not specialised by width).
        self.simd_width = simd_width
        self._attributes: dict[str, int] | None = None

    @property
    def attributes(self) -> dict[str, int]:
        if self._attributes is None:
            self._attributes = {k: int(v) for k, v in self.raw.attributes.items()}
        return dict(self._attributes)

    def forget_attributes(self) -> None:
        self._attributes = None

    def __repr__(self) -> str:
        return f"<CupyKernel {self.name} from {self.source_name}>"


class CupyLauncher(KernelLauncher):
    """Compiles through ``cupy.RawModule`` for one device and launches on its streams.

    ``platform`` supplies the compiler options and the shared-memory opt-in
    limit; without one (tests, foreign sources) only the source's options are
    passed and the block limit is the device's.
    """

    source_suffix = ".cu"

    def __init__(self, device_index: int, capabilities: DeviceCapabilities | Callable[[], DeviceCapabilities],
                 *, fmad: bool | None = None, platform: GpuPlatform | None = None) -> None:
        self._device_index = device_index
        self._caps = capabilities
        self._platform = platform
        self._fmad = fmad
        self._cache: dict[tuple[str, str], dict[str, CompiledKernel]] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> DeviceCapabilities:
        if callable(self._caps):
            self._caps = self._caps()
        return self._caps

    @property
    def device_index(self) -> int:
        return self._device_index

    def compile_options(self, source: KernelSource) -> tuple[str, ...]:
        """The options passed to the runtime compiler besides CuPy's own (arch, ``-std=c++17`` ...)."""
        if self._platform is None:
            return tuple(source.options)
        fmad = _env.fmad(self._platform.name) if self._fmad is None else self._fmad
        return (*source.options, *self._platform.compile_options(fmad=fmad))

    def cache_key(self, source: KernelSource) -> tuple[str, str]:
        """``(digest of code and every option, arch)``."""
        import hashlib  # where a kernel is compiled, not when the plugin is discovered

        hasher = hashlib.sha256(source.digest.encode())
        for option in self.compile_options(source)[len(source.options):]:
            hasher.update(b"\0" + option.encode())
        return hasher.hexdigest(), self.capabilities.arch

    def load(self, source: KernelSource) -> dict[str, CompiledKernel]:
        key = self.cache_key(source)
        with self._lock:
            found = self._cache.get(key)
        if found is None:  # compiled outside the lock: other sources may compile in parallel
            compiled = self._compile(source)
            with self._lock:
                found = self._cache.setdefault(key, compiled)
        return dict(found)

    def _compile(self, source: KernelSource) -> dict[str, CompiledKernel]:
        cp = cupy()
        options = self.compile_options(source)
        with cp.cuda.Device(self._device_index):
            module = cp.RawModule(code=source.code, options=options)
            try:
                module.compile()
                width = compiled_simd_width(source.options)
                kernels: dict[str, CompiledKernel] = {
                    name: CupyKernel(name, module.get_function(name), source.name, width)
                    for name in source.entry_points}
            except cp.cuda.compiler.CompileException as exc:
                raise KernelCompileError(source.name, exc.get_message(), options) from exc
            except cp.cuda.driver.CUDADriverError as exc:  # e.g. an entry point missing from the module
                raise KernelCompileError(source.name, f"loading the module failed: {exc}", options) from exc
        return kernels

    def _launch(self, kernel: CompiledKernel, config: LaunchConfig, args: Sequence[Any], stream: Any) -> None:
        if not isinstance(kernel, CupyKernel):
            raise TypeError(f"CupyLauncher launches CupyKernel objects, got {type(kernel).__name__}")
        caps = self.capabilities
        if kernel.simd_width is not None and kernel.simd_width != caps.simd_width:
            raise LaunchConfigError(
                f"kernel {kernel.name!r} was compiled for a SIMD width of {kernel.simd_width} lanes but "
                f"{caps.name} runs {caps.simd_width}; load the specialisation for {caps.simd_width} lanes"
            )
        cp = cupy()
        attrs = kernel.attributes
        static = attrs.get("shared_size_bytes", 0)
        optin = caps.shared_mem_per_block_optin
        if static + config.shared_mem > optin:
            raise LaunchConfigError(
                f"kernel {kernel.name!r} uses {static} bytes of static and asks {config.shared_mem} bytes of "
                f"dynamic shared memory; {self.capabilities.name} allows {optin} per block"
            )
        with cp.cuda.Device(self._device_index):
            if static + config.shared_mem > self.shared_limit() and \
                    config.shared_mem > attrs.get("max_dynamic_shared_size_bytes", 0):
                kernel.raw.max_dynamic_shared_size_bytes = config.shared_mem  # opt in beyond 48 KiB
                kernel.forget_attributes()
            with native_stream(stream, self._device_index):
                kernel.raw(config.grid, config.block, tuple(kernel_arg(a) for a in args),
                           shared_mem=config.shared_mem)

    def shared_limit(self) -> int:
        """Shared memory per block usable without opting in (the platform's rule, else the device's limit)."""
        if self._platform is None:
            return self.capabilities.shared_mem_per_block
        return self._platform.static_shared_limit(self.capabilities)

    def blocks_per_cu(self, kernel: CompiledKernel, threads_per_block: int, shared_mem: int = 0) -> int:
        """Resident blocks per compute unit of ``kernel`` at this block size (the runtime's occupancy calculator)."""
        if isinstance(kernel, CupyKernel):
            cp = cupy()
            with cp.cuda.Device(self._device_index):
                try:
                    found = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        kernel.raw.kernel.ptr, threads_per_block, shared_mem)
                except Exception:  # older CuPy without the binding: fall back to the thread limit
                    found = 0
            if found > 0:
                return int(found)
        return max(1, self.capabilities.max_threads_per_cu // threads_per_block)

    def config_for(self, kernel: CompiledKernel, work_items: int, *, threads_per_block: int | None = None,
                   shared_mem: int = 0) -> LaunchConfig:
        """A 1-D grid-stride config: block from the kernel's limit, grid from compute units x occupancy."""
        caps = self.capabilities
        base = super().config_for(kernel, work_items, threads_per_block=threads_per_block, shared_mem=shared_mem)
        threads = base.block[0]
        grid = grid_for(caps, work_items, threads, blocks_per_cu=self.blocks_per_cu(kernel, threads, shared_mem))
        return LaunchConfig(grid=(max(1, grid),), block=(threads,), shared_mem=shared_mem)
