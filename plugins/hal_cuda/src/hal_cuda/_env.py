"""The ``HAL_CUDA_*`` environment variables, read in one place (see docs/cuda.md)."""

from __future__ import annotations

import os

__all__ = ["allocator_policy", "fmad", "offload_min_flops", "packed_cache_bytes", "small_m_max", "tensor_cores"]

#: Default of ``HAL_CUDA_OFFLOAD_MIN_FLOPS``: 2**24 (about 16.8 MFLOP), roughly a millisecond of
#: numpy work against the ~0.1 ms fixed cost of a host-device round trip (see docs/cuda.md).
DEFAULT_OFFLOAD_MIN_FLOPS = 1 << 24


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def offload_min_flops() -> int:
    """``HAL_CUDA_OFFLOAD_MIN_FLOPS``: host (numpy) inputs run on the GPU only from this many FLOPs."""
    return _int("HAL_CUDA_OFFLOAD_MIN_FLOPS", DEFAULT_OFFLOAD_MIN_FLOPS)


def small_m_max(default: int) -> int:
    """``HAL_CUDA_SMALL_M_MAX``: largest M of quantized_gemm that uses the fused small-M kernel."""
    return _int("HAL_CUDA_SMALL_M_MAX", default)


def fmad() -> bool:
    """``HAL_CUDA_FMAD=0`` compiles kernels with ``-fmad=false`` (bit-reproducible, slower)."""
    return os.environ.get("HAL_CUDA_FMAD", "1").strip().lower() not in {"0", "false", "no", "off"}


def allocator_policy() -> str:
    """``HAL_CUDA_ALLOCATOR``: ``caching`` (default), ``async`` or ``managed``."""
    value = os.environ.get("HAL_CUDA_ALLOCATOR", "caching").strip().lower() or "caching"
    if value not in {"caching", "async", "managed"}:
        raise ValueError(f"HAL_CUDA_ALLOCATOR={value!r}; expected caching, async or managed")
    return value


def tensor_cores() -> bool:
    """``HAL_CUDA_TENSOR_CORES=0`` keeps quantized_gemm and paged_attention on the CUDA-core kernels even where
    tensor cores exist."""
    return os.environ.get("HAL_CUDA_TENSOR_CORES", "1").strip().lower() not in {"0", "false", "no", "off"}


def packed_cache_bytes() -> int:
    """``HAL_CUDA_PACKED_CACHE_MB``: bound of the tensor-core weight cache per process (default 16384 MiB)."""
    return _int("HAL_CUDA_PACKED_CACHE_MB", 16384) << 20
