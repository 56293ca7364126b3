"""The ``HAL_<BACKEND>_*`` environment variables, read in one place (see docs/cuda.md, docs/rocm.md).

Each variable is named after the backend that reads it: the CUDA backend reads
``HAL_CUDA_OFFLOAD_MIN_FLOPS``, the ROCm backend ``HAL_ROCM_OFFLOAD_MIN_FLOPS``.
Values are parsed by :mod:`hal_core.env`, so they follow hal's spellings and
error messages.
"""

from __future__ import annotations

from hal_core import env

__all__ = ["ALLOCATOR_POLICIES", "allocator_policy", "fmad", "offload_min_flops", "packed_cache_bytes", "small_m_max",
           "tensor_cores", "variable"]

#: Default of ``HAL_<BACKEND>_OFFLOAD_MIN_FLOPS``: 2**24 (about 16.8 MFLOP), roughly a millisecond of
#: numpy work against the ~0.1 ms fixed cost of a host-device round trip (see docs/cuda.md).
DEFAULT_OFFLOAD_MIN_FLOPS = 1 << 24

#: Policies ``HAL_<BACKEND>_ALLOCATOR`` accepts.
ALLOCATOR_POLICIES = ("caching", "async", "managed")

#: Default of ``HAL_<BACKEND>_PACKED_CACHE_MB``: bound of the tensor-core weight cache per process, MiB.
DEFAULT_PACKED_CACHE_MB = 16384


def variable(backend: str, setting: str) -> str:
    """``HAL_<BACKEND>_<SETTING>``, e.g. ``variable("cuda", "FMAD") == "HAL_CUDA_FMAD"``."""
    return f"HAL_{backend.upper()}_{setting}"


def offload_min_flops(backend: str) -> int:
    """``HAL_<BACKEND>_OFFLOAD_MIN_FLOPS``: host (numpy) inputs run on the GPU only from this many FLOPs."""
    return env.integer(variable(backend, "OFFLOAD_MIN_FLOPS"), DEFAULT_OFFLOAD_MIN_FLOPS, minimum=0)


def small_m_max(backend: str, default: int) -> int:
    """``HAL_<BACKEND>_SMALL_M_MAX``: largest M of quantized_gemm that uses the fused small-M kernel."""
    return env.integer(variable(backend, "SMALL_M_MAX"), default, minimum=0)


def fmad(backend: str) -> bool:
    """``HAL_<BACKEND>_FMAD`` (default on): off compiles kernels without multiply-add contraction."""
    return env.flag(variable(backend, "FMAD"), default=True)


def allocator_policy(backend: str) -> str:
    """``HAL_<BACKEND>_ALLOCATOR``: ``caching`` (default), ``async`` or ``managed``."""
    return env.choice(variable(backend, "ALLOCATOR"), "caching", ALLOCATOR_POLICIES)


def tensor_cores(backend: str) -> bool:
    """``HAL_<BACKEND>_TENSOR_CORES`` (default on): off keeps quantized_gemm and paged_attention on the SIMT kernels."""
    return env.flag(variable(backend, "TENSOR_CORES"), default=True)


def packed_cache_bytes(backend: str) -> int:
    """``HAL_<BACKEND>_PACKED_CACHE_MB``: bound of the tensor-core weight cache per process, in bytes."""
    return env.integer(variable(backend, "PACKED_CACHE_MB"), DEFAULT_PACKED_CACHE_MB, minimum=0) << 20
