"""Specialisations and pure launch rules of ``write_kv_cache``: ``write_kv_cache.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._write_kv_cache` calls
them.  One byte-copying build serves every dtype, so a specialisation differs
only by the slot dtype and the SIMD width.  ``hal_cupy/kernels/README.md``
documents the kernel's parameters.
"""

from __future__ import annotations

from .._specialization import Launch, Specialization, warp_define

__all__ = ["specializations", "write_kv_cache_launch", "write_kv_cache_spec"]


def write_kv_cache_spec(slot_int64: bool = True, warp_size: int = 32) -> Specialization:
    """``write_kv_cache.cu`` for int64 (``slot_int64``) or int32 slot mappings, at ``warp_size`` lanes."""
    return Specialization(
        "write_kv_cache.cu", ("hal_write_kv_cache",),
        (("HAL_SLOT_INT64", "1" if slot_int64 else "0"), warp_define(warp_size)),
    )


def write_kv_cache_launch(num_tokens: int) -> Launch:
    """One CTA of 128 threads per token; row_bytes = head_size * element size."""
    return Launch("hal_write_kv_cache", (num_tokens, 1, 1), (128, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``write_kv_cache`` may request at ``warp_size`` lanes: int64, then int32 slot mappings."""
    return [write_kv_cache_spec(True, warp_size), write_kv_cache_spec(False, warp_size)]
