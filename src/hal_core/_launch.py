"""Kernel sources, launch configurations and the launcher contract."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ._errors import LaunchConfigError

if TYPE_CHECKING:
    from ._capabilities import DeviceCapabilities

__all__ = ["CompiledKernel", "KernelLauncher", "KernelSource", "LaunchConfig", "grid_for"]

Dim3 = tuple[int, int, int]


def _dim3(value: int | Sequence[int], what: str) -> Dim3:
    try:
        dims = (value,) if isinstance(value, int) else tuple(value)
    except TypeError:
        raise LaunchConfigError(f"{what} must be 1 to 3 integers, got {value!r}") from None
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise LaunchConfigError(f"{what} must be 1 to 3 integers, got {value!r}")
    if any(d < 1 for d in dims):
        raise LaunchConfigError(f"{what} dimensions must be >= 1, got {dims}")
    padded = (*dims, 1, 1)
    return (padded[0], padded[1], padded[2])


@dataclass(frozen=True, init=False)
class LaunchConfig:
    """Grid, block and dynamic shared memory of one launch (frozen, hashable).

    ``grid`` and ``block`` take an int or 1 to 3 positive ints
    (``LaunchConfig(128, (16, 16))``) and are stored as 3-tuples.
    :meth:`validate` checks them against a device before launch.
    """

    grid: Dim3
    block: Dim3
    shared_mem: int = 0

    def __init__(self, grid: int | Sequence[int], block: int | Sequence[int], shared_mem: int = 0) -> None:
        object.__setattr__(self, "grid", _dim3(grid, "grid"))
        object.__setattr__(self, "block", _dim3(block, "block"))
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
            raise LaunchConfigError(f"shared_mem must be an int >= 0, got {shared_mem!r}")
        object.__setattr__(self, "shared_mem", shared_mem)

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def validate(self, caps: DeviceCapabilities) -> None:
        """Raise :class:`LaunchConfigError` naming the first device limit exceeded."""
        if self.threads_per_block > caps.max_threads_per_block:
            raise LaunchConfigError(
                f"block {self.block} has {self.threads_per_block} threads; "
                f"max_threads_per_block of {caps.name} is {caps.max_threads_per_block}"
            )
        for axis, (size, limit) in enumerate(zip(self.block, caps.max_block_dims, strict=False)):
            if size > limit:
                raise LaunchConfigError(
                    f"block dimension {axis} is {size}; max_block_dims[{axis}] of {caps.name} is {limit}"
                )
        for axis, (size, limit) in enumerate(zip(self.grid, caps.max_grid_dims, strict=False)):
            if size > limit:
                raise LaunchConfigError(
                    f"grid dimension {axis} is {size}; max_grid_dims[{axis}] of {caps.name} is {limit}"
                )
        if self.shared_mem > caps.shared_mem_per_block_optin:
            raise LaunchConfigError(
                f"shared_mem is {self.shared_mem} bytes; shared_mem_per_block_optin of "
                f"{caps.name} is {caps.shared_mem_per_block_optin}"
            )


def grid_for(
    caps: DeviceCapabilities,
    work_items: int,
    threads_per_block: int,
    *,
    blocks_per_cu: int | None = None,
) -> int:
    """A 1-D grid size for ``work_items`` threads, derived from the device.

    Covers the work when it is small; otherwise caps the grid at enough
    blocks to fill every compute unit (``blocks_per_cu`` resident blocks
    each, by default as many as the thread limit per CU allows) and lets
    kernels loop grid-stride over the rest.
    """
    if work_items <= 0:
        return 0
    if not 0 < threads_per_block <= caps.max_threads_per_block:
        raise LaunchConfigError(
            f"threads_per_block must be in 1..{caps.max_threads_per_block} for {caps.name}, "
            f"got {threads_per_block}"
        )
    resident = blocks_per_cu or max(1, caps.max_threads_per_cu // threads_per_block)
    needed = math.ceil(work_items / threads_per_block)
    return max(1, min(needed, caps.compute_units * resident, caps.max_grid_dims[0]))


@dataclass(frozen=True)
class KernelSource:
    """Source text of one compilation unit plus its options (frozen, hashable).

    ``entry_points`` are the kernel names to fetch from the compiled module.
    The compile cache key is ``(digest, arch)``; :attr:`digest` covers the
    code and the options.
    """

    name: str
    code: str = field(repr=False)
    entry_points: tuple[str, ...]
    options: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        import hashlib  # where a kernel is hashed, not at start-up (OpenSSL takes milliseconds to load)

        hasher = hashlib.sha256(self.code.encode())
        for option in self.options:
            hasher.update(b"\0" + option.encode())
        return hasher.hexdigest()

    @classmethod
    def from_package(
        cls,
        filename: str,
        entry_points: Sequence[str],
        *,
        prelude: str | None = None,
        options: Sequence[str] = (),
        package: str,
    ) -> KernelSource:
        """Load ``filename`` from the package data of ``package`` (the plugin shipping the kernel),
        optionally prefixed by a prelude file of the same package."""
        from importlib import resources  # only where a kernel is loaded: it costs milliseconds to import

        root = resources.files(package)
        code = root.joinpath(filename).read_text()
        if prelude is not None:
            code = root.joinpath(prelude).read_text() + "\n" + code
        return cls(filename, code, tuple(entry_points), tuple(options))


class CompiledKernel(ABC):
    """A kernel ready to launch on one device."""

    name: str

    @property
    @abstractmethod
    def attributes(self) -> dict[str, int]:
        """Compiled attributes: at least ``max_threads_per_block``, ``num_regs``, ``shared_size_bytes``."""
        raise NotImplementedError("The 'attributes' property must be implemented.")


class KernelLauncher(ABC):
    """Compiles kernels for one device and launches them on its streams.

    :attr:`source_suffix` names the kernel language :meth:`load` accepts by
    the file suffix of its sources (``".py"`` for host Python kernels); the
    conformance kit picks its test kernel by it.
    """

    #: File suffix of the kernel sources this launcher compiles (e.g. ``".py"``); empty when undeclared.
    source_suffix: ClassVar[str] = ""

    @property
    @abstractmethod
    def capabilities(self) -> DeviceCapabilities:
        """The device the launcher targets."""
        raise NotImplementedError("The 'capabilities' property must be implemented.")

    @abstractmethod
    def load(self, source: KernelSource) -> dict[str, CompiledKernel]:
        """Compile ``source`` (cached by digest and arch) and return its entry points by name.

        Raises :class:`KernelCompileError` with the compiler log on failure.
        """
        raise NotImplementedError("The 'load' method must be implemented.")

    @abstractmethod
    def _launch(self, kernel: CompiledKernel, config: LaunchConfig, args: Sequence[Any], stream: Any) -> None:
        """Enqueue an already validated launch."""
        raise NotImplementedError("The '_launch' method must be implemented.")

    def launch(
        self, kernel: CompiledKernel, config: LaunchConfig, args: Sequence[Any], stream: Any = None
    ) -> None:
        """Validate ``config`` against the device and the kernel, then enqueue it on ``stream``."""
        config.validate(self.capabilities)
        limit = kernel.attributes.get("max_threads_per_block")
        if limit and config.threads_per_block > limit:
            raise LaunchConfigError(
                f"block of {config.threads_per_block} threads exceeds kernel {kernel.name!r}'s "
                f"max_threads_per_block {limit} (register pressure)"
            )
        self._launch(kernel, config, args, stream)

    def config_for(
        self,
        kernel: CompiledKernel,
        work_items: int,
        *,
        threads_per_block: int | None = None,
        shared_mem: int = 0,
    ) -> LaunchConfig:
        """A 1-D launch config covering ``work_items`` threads, derived from the device and kernel.

        The block size defaults to the largest multiple of the SIMD width
        the kernel allows, at most 256; the grid comes from :func:`grid_for`.
        """
        caps = self.capabilities
        kernel_limit = kernel.attributes.get("max_threads_per_block") or caps.max_threads_per_block
        limit = min(caps.max_threads_per_block, kernel_limit)
        if threads_per_block is None:
            threads_per_block = max(caps.simd_width, min(256, limit) // caps.simd_width * caps.simd_width)
        grid = max(1, grid_for(caps, work_items, threads_per_block))
        return LaunchConfig(grid=(grid,), block=(threads_per_block,), shared_mem=shared_mem)
