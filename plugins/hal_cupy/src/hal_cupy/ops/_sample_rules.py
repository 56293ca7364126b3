"""Specialisations and pure launch rules of ``sample``: ``sample.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._sample` calls them. A specialisation differs by the
logits' dtype and the SIMD width; ``hal_cupy/kernels/README.md`` documents the kernel's parameters.
"""

from __future__ import annotations

from .._specialization import Launch, Specialization, dtype_code, warp_define

__all__ = ["SAMPLE_THREADS", "sample_launch", "sample_spec", "specializations"]

#: Threads of the CTA that samples one row (the kernel's HAL_NUM_THREADS default).
SAMPLE_THREADS = 256


def sample_spec(dtype: str | int, warp_size: int = 32) -> Specialization:
    """``sample.cu`` for logits of ``dtype`` (a name of ``DTYPE_CODES`` or a HAL_DTYPE code), at ``warp_size`` lanes."""
    return Specialization("sample.cu", ("hal_sample",),
                          (("HAL_DTYPE", str(dtype_code(dtype))), warp_define(warp_size)))


def sample_launch(num_seqs: int) -> Launch:
    """One CTA of :data:`SAMPLE_THREADS` threads per row."""
    return Launch("hal_sample", (num_seqs, 1, 1), (SAMPLE_THREADS, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``sample`` may request at ``warp_size`` lanes: fp32, fp16, bf16 logits."""
    return [sample_spec(code, warp_size) for code in (0, 1, 2)]
