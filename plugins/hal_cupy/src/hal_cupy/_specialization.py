"""What every op's kernel specialisations and launch rules share: the compile unit, the launch, dtype codes.

Everything here is plain Python (no CuPy, no driver). The kernel sources live
in ``hal_cupy/kernels`` and are specialised by preprocessor defines; each op
keeps its specialisations and pure launch rules beside its implementation
(``hal_cupy/ops/_<op>_rules.py``), built from the pieces below, and
:func:`hal_cupy.all_specializations` gathers them op by op.  A compiled module
is identified by (source text hash, options, arch), where the options are
:meth:`Specialization.options`.

Every specialisation names the SIMD width it is compiled for
(``HAL_WARP_SIZE``: 32 for NVIDIA warps and RDNA wave32, 64 for CDNA
wavefronts), read from the device's capabilities; the launcher refuses to
run it on a device of another width.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DTYPE_CODES",
    "ELEM_BYTES",
    "SIMD_WIDTHS",
    "Launch",
    "Specialization",
    "dtype_code",
    "pow2ceil",
    "warp_define",
]

#: HAL_DTYPE codes by dtype name (x/query/out element type).
DTYPE_CODES: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 2}
#: Bytes per element, by HAL_DTYPE code.
ELEM_BYTES: dict[int, int] = {0: 4, 1: 2, 2: 2}
#: SIMD widths the kernels are written for (warp / wavefront lanes).
SIMD_WIDTHS = (32, 64)


@dataclass(frozen=True)
class Specialization:
    """One compile unit: a source file built with a fixed set of defines."""

    source: str
    kernels: tuple[str, ...]
    defines: tuple[tuple[str, str], ...]
    #: Lowest level of warp matrix instructions (``hal_mma.cuh``; numbered like compute capabilities,
    #: major * 10 + minor) the source needs, compared with :meth:`~hal_cupy.GpuPlatform.warp_mma_level`;
    #: 0: every target.  Non-zero marks a tensor-core source, built only where the platform provides them.
    min_sm: int = 0

    def options(self) -> tuple[str, ...]:
        """``-D`` options for the compiler (the arch and the platform's own options are not included)."""
        return tuple(f"-D{k}={v}" for k, v in self.defines)

    @property
    def id(self) -> str:
        """Short readable name, e.g. ``paged_attention[DTYPE=1,HEAD_SIZE=128,GQA=8]``."""
        stem = self.source.rsplit(".", 1)[0]
        args = ",".join(f"{k.removeprefix('HAL_')}={v}" for k, v in self.defines)
        return f"{stem}[{args}]"


@dataclass(frozen=True)
class Launch:
    """A kernel launch: grid and block as (x, y, z), dynamic shared memory bytes."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0


def dtype_code(dtype: str | int) -> int:
    """The HAL_DTYPE code of a dtype name of :data:`DTYPE_CODES` (a code is returned as it is, if known)."""
    if isinstance(dtype, int):
        if dtype not in ELEM_BYTES:
            raise ValueError(f"unknown HAL_DTYPE code {dtype}")
        return dtype
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None


def warp_define(warp_size: int) -> tuple[str, str]:
    """The ``HAL_WARP_SIZE`` define for a SIMD width of :data:`SIMD_WIDTHS`."""
    if warp_size not in SIMD_WIDTHS:
        raise ValueError(f"warp_size must be one of {SIMD_WIDTHS}, got {warp_size}")
    return ("HAL_WARP_SIZE", str(warp_size))


def pow2ceil(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())
