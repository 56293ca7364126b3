"""Specialisations and pure launch rules of ``rotary_embedding``: ``rotary_embedding.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._rotary_embedding` calls them.  A specialisation
differs by the element dtype, the positions' integer width and the SIMD width; the pairing (NeoX or GPT-J)
is a runtime argument.  ``hal_cupy/kernels/README.md`` documents the kernel's parameters.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, Launch, Specialization, dtype_code, warp_define

__all__ = ["ROTARY_THREADS", "rotary_embedding_launch", "rotary_embedding_spec", "specializations"]

#: Threads per CTA (one CTA per token; they walk its heads' pairs).
ROTARY_THREADS = 128


def rotary_embedding_spec(dtype: str, pos_int64: bool = True, warp_size: int = 32) -> Specialization:
    """``rotary_embedding.cu`` for query/key ``dtype``, int64 (``pos_int64``) or int32 positions, ``warp_size``."""
    return Specialization(
        "rotary_embedding.cu", ("hal_rotary_embedding",),
        (("HAL_DTYPE", str(dtype_code(dtype))), ("HAL_POS_INT64", "1" if pos_int64 else "0"),
         warp_define(warp_size)),
    )


def rotary_embedding_launch(num_tokens: int) -> Launch:
    """One CTA of :data:`ROTARY_THREADS` threads per token."""
    return Launch("hal_rotary_embedding", (num_tokens, 1, 1), (ROTARY_THREADS, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``rotary_embedding`` may request at ``warp_size`` lanes: per dtype, int64 then int32."""
    return [rotary_embedding_spec(dtype, pos_int64, warp_size) for dtype in DTYPE_CODES for pos_int64 in (True, False)]
