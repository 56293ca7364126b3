"""The ``HAL_<BACKEND>_*`` environment variables, read in one place (see docs/cuda.md, docs/rocm.md).

Each variable is named after the backend that reads it: the CUDA backend reads
``HAL_CUDA_OFFLOAD_MIN_FLOPS``, the ROCm backend ``HAL_ROCM_OFFLOAD_MIN_FLOPS``.
"""

from __future__ import annotations

import os

__all__ = ["allocator_policy", "fmad", "offload_min_flops", "small_m_max", "variable"]

#: Default of ``HAL_<BACKEND>_OFFLOAD_MIN_FLOPS``: 2**24 (about 16.8 MFLOP), roughly a millisecond of
#: numpy work against the ~0.1 ms fixed cost of a host-device round trip (see docs/cuda.md).
DEFAULT_OFFLOAD_MIN_FLOPS = 1 << 24


def variable(backend: str, setting: str) -> str:
    """``HAL_<BACKEND>_<SETTING>``, e.g. ``variable("cuda", "FMAD") == "HAL_CUDA_FMAD"``."""
    return f"HAL_{backend.upper()}_{setting}"


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def offload_min_flops(backend: str) -> int:
    """``HAL_<BACKEND>_OFFLOAD_MIN_FLOPS``: host (numpy) inputs run on the GPU only from this many FLOPs."""
    return _int(variable(backend, "OFFLOAD_MIN_FLOPS"), DEFAULT_OFFLOAD_MIN_FLOPS)


def small_m_max(backend: str, default: int) -> int:
    """``HAL_<BACKEND>_SMALL_M_MAX``: largest M of quantized_gemm that uses the fused small-M kernel."""
    return _int(variable(backend, "SMALL_M_MAX"), default)


def fmad(backend: str) -> bool:
    """``HAL_<BACKEND>_FMAD=0`` compiles kernels without multiply-add contraction (bit-reproducible, slower)."""
    return os.environ.get(variable(backend, "FMAD"), "1").strip().lower() not in {"0", "false", "no", "off"}


def allocator_policy(backend: str) -> str:
    """``HAL_<BACKEND>_ALLOCATOR``: ``caching`` (default), ``async`` or ``managed``."""
    name = variable(backend, "ALLOCATOR")
    value = os.environ.get(name, "caching").strip().lower() or "caching"
    if value not in {"caching", "async", "managed"}:
        raise ValueError(f"{name}={value!r}; expected caching, async or managed")
    return value
