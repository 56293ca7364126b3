"""The ``HAL_CUDA_*`` environment variables, read in one place (see docs/environment.md).

Values are parsed by :mod:`hal_core.env`, so they follow hal's spellings and
error messages.
"""

from __future__ import annotations

from hal_core import env

__all__ = ["allocator_policy", "fmad", "offload_min_flops", "small_m_max"]

#: Default of ``HAL_CUDA_OFFLOAD_MIN_FLOPS``: 2**24 (about 16.8 MFLOP), roughly a millisecond of
#: numpy work against the ~0.1 ms fixed cost of a host-device round trip (see docs/cuda.md).
DEFAULT_OFFLOAD_MIN_FLOPS = 1 << 24

#: Policies ``HAL_CUDA_ALLOCATOR`` accepts.
ALLOCATOR_POLICIES = ("caching", "async", "managed")


def offload_min_flops() -> int:
    """``HAL_CUDA_OFFLOAD_MIN_FLOPS``: host (numpy) inputs run on the GPU only from this many FLOPs."""
    return env.integer("HAL_CUDA_OFFLOAD_MIN_FLOPS", DEFAULT_OFFLOAD_MIN_FLOPS, minimum=0)


def small_m_max(default: int) -> int:
    """``HAL_CUDA_SMALL_M_MAX``: largest M of quantized_gemm that uses the fused small-M kernel."""
    return env.integer("HAL_CUDA_SMALL_M_MAX", default, minimum=0)


def fmad() -> bool:
    """``HAL_CUDA_FMAD`` (default on): off compiles kernels with ``-fmad=false`` (bit-reproducible, slower)."""
    return env.flag("HAL_CUDA_FMAD", default=True)


def allocator_policy() -> str:
    """``HAL_CUDA_ALLOCATOR``: ``caching`` (default), ``async`` or ``managed``."""
    return env.choice("HAL_CUDA_ALLOCATOR", "caching", ALLOCATOR_POLICIES)
