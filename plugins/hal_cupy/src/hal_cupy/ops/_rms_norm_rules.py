"""Specialisations and pure launch rules of ``rms_norm``: ``rms_norm.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._rms_norm` calls them. A specialisation differs by
dtype and SIMD width only. ``hal_cupy/kernels/README.md`` documents the kernel's parameters.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, Launch, Specialization, dtype_code, warp_define

__all__ = ["NUM_THREADS", "rms_norm_launch", "rms_norm_spec", "specializations"]

#: Threads per CTA (whole warps and wavefronts); one CTA normalises one row.
NUM_THREADS = 256


def rms_norm_spec(dtype: str | int, warp_size: int = 32) -> Specialization:
    """``rms_norm.cu`` for one dtype at ``warp_size`` lanes."""
    return Specialization("rms_norm.cu", ("hal_rms_norm",),
                          (("HAL_DTYPE", str(dtype_code(dtype))), warp_define(warp_size)))


def rms_norm_launch(num_tokens: int) -> Launch:
    """One CTA of :data:`NUM_THREADS` threads per row."""
    return Launch("hal_rms_norm", (num_tokens, 1, 1), (NUM_THREADS, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``rms_norm`` may request at ``warp_size`` lanes (one per dtype)."""
    return [rms_norm_spec(dtype, warp_size) for dtype in DTYPE_CODES]
