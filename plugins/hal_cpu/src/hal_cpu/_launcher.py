"""Host kernels: Python callables "compiled" from a KernelSource and run over a grid.

Convention for a CPU :class:`~hal_core.KernelSource`:

- ``code`` is either a dotted module name (``"mypkg.kernels"``), imported,
  or Python source text, executed in a fresh module named after the source;
- each of ``entry_points`` names a callable in that module with the
  signature ``kernel(ctx: BlockContext, *args)``.

A launch calls the kernel once per block of the grid; the blocks are
spread over a thread pool of one worker per core, in chunks, on the
stream's worker thread. A block vectorises over its threads with numpy
(``ctx.thread_ids``); numpy releases the GIL in its loops, so blocks run
in parallel where they do real array work. Loads are cached by
``(digest, arch)`` like a compiled module.
"""

from __future__ import annotations

import importlib
import itertools
import re
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hal_core import CompiledKernel, KernelCompileError, KernelLauncher, KernelSource, LaunchConfig

from ._stream import CpuStream

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities, DeviceHandle

__all__ = ["BlockContext", "CpuKernel", "CpuLauncher"]

_MODULE_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True)
class BlockContext:
    """What one block of a host kernel knows: CUDA's ``blockIdx``, ``blockDim``, ``gridDim`` and shared memory."""

    block_idx: tuple[int, int, int]
    block_dim: tuple[int, int, int]
    grid_dim: tuple[int, int, int]
    shared: np.ndarray = field(repr=False)

    @property
    def threads_per_block(self) -> int:
        return self.block_dim[0] * self.block_dim[1] * self.block_dim[2]

    @property
    def block_linear(self) -> int:
        """The block's index in x-fastest order."""
        x, y, z = self.block_idx
        return x + self.grid_dim[0] * (y + self.grid_dim[1] * z)

    @property
    def thread_ids(self) -> np.ndarray:
        """Linear thread indices within the block, ``0 .. threads_per_block - 1``."""
        return np.arange(self.threads_per_block)

    @property
    def global_ids(self) -> np.ndarray:
        """Linear thread indices across the grid (``block_linear * threads_per_block + thread``)."""
        return self.block_linear * self.threads_per_block + self.thread_ids

    @property
    def total_threads(self) -> int:
        """Threads in the whole grid (the stride of a grid-stride loop)."""
        return self.threads_per_block * self.grid_dim[0] * self.grid_dim[1] * self.grid_dim[2]


class CpuKernel(CompiledKernel):
    """A host kernel: a Python callable run once per block."""

    def __init__(self, name: str, fn: Callable[..., Any], caps: DeviceCapabilities) -> None:
        self.name = name
        self.fn = fn
        self._attributes = {
            "max_threads_per_block": caps.max_threads_per_block,
            "num_regs": 0,
            "shared_size_bytes": 0,
        }

    @property
    def attributes(self) -> dict[str, int]:
        return dict(self._attributes)

    def __repr__(self) -> str:
        return f"<CpuKernel {self.name!r}>"


def _compile(source: KernelSource) -> types.ModuleType:
    code = source.code.strip()
    if _MODULE_NAME.match(code):
        try:
            return importlib.import_module(code)
        except Exception as exc:
            raise KernelCompileError(source.name, traceback.format_exc(), source.options) from exc
    module = types.ModuleType(f"hal_cpu_kernel_{source.digest[:12]}")
    module.__file__ = f"<hal kernel {source.name}>"
    try:
        exec(compile(source.code, module.__file__, "exec"), module.__dict__)
    except Exception as exc:
        raise KernelCompileError(source.name, traceback.format_exc(), source.options) from exc
    return module


class CpuLauncher(KernelLauncher):
    """Loads host kernels and runs them over a grid on a thread pool (one worker per core)."""

    source_suffix = ".py"

    def __init__(self, device: DeviceHandle) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], types.ModuleType] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def capabilities(self) -> DeviceCapabilities:
        return self._device.capabilities

    def load(self, source: KernelSource) -> dict[str, CompiledKernel]:
        caps = self.capabilities
        key = (source.digest, caps.arch)
        with self._lock:
            module = self._cache.get(key)
        if module is None:
            module = _compile(source)
            with self._lock:
                module = self._cache.setdefault(key, module)
        kernels: dict[str, CompiledKernel] = {}
        for entry in source.entry_points:
            fn = getattr(module, entry, None)
            if not callable(fn):
                raise KernelCompileError(
                    source.name, f"entry point {entry!r} is not a callable defined by the source", source.options
                )
            kernels[entry] = CpuKernel(entry, fn, caps)
        return kernels

    def cache_size(self) -> int:
        """Number of loaded sources in the cache."""
        with self._lock:
            return len(self._cache)

    def _launch(self, kernel: CompiledKernel, config: LaunchConfig, args: Sequence[Any], stream: Any) -> None:
        if not isinstance(kernel, CpuKernel):
            raise TypeError(f"expected a CpuKernel from CpuLauncher.load, got {type(kernel).__name__}")
        target = stream if stream is not None else self._device.current_stream()
        if not isinstance(target, CpuStream):
            raise TypeError(f"expected a CpuStream to launch on, got {type(target).__name__}")
        arguments = tuple(args)
        target.submit(lambda: self._run_grid(kernel, config, arguments))

    def _run_grid(self, kernel: CpuKernel, config: LaunchConfig, args: tuple[Any, ...]) -> None:
        gx, gy, _ = config.grid
        total = config.num_blocks
        workers = self.capabilities.compute_units

        def run_chunk(start: int, stop: int) -> None:
            shared = np.zeros(config.shared_mem, dtype=np.uint8)
            for linear in range(start, stop):
                x, rest = linear % gx, linear // gx
                shared[:] = 0
                ctx = BlockContext((x, rest % gy, rest // gy), config.block, config.grid, shared)
                kernel.fn(ctx, *args)

        if workers == 1 or total == 1:
            run_chunk(0, total)
            return
        chunks = min(total, 4 * workers)
        bounds = np.linspace(0, total, chunks + 1).astype(np.int64)
        pool = self._executor()
        futures = [pool.submit(run_chunk, int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        for future in futures:
            future.result()  # re-raises the first kernel error on the stream

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.capabilities.compute_units, thread_name_prefix="hal-cpu-block")
            return self._pool
