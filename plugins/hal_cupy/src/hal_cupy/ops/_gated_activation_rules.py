"""Specialisations and pure launch rules of ``gated_activation``: ``gated_activation.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._gated_activation` calls them. A specialisation differs
by dtype and SIMD width only (the activation is a kernel parameter, :data:`ACTIVATION_CODES`).
``hal_cupy/kernels/README.md`` documents the kernel's parameters.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, ELEM_BYTES, Launch, Specialization, dtype_code, warp_define

__all__ = ["ACTIVATION_CODES", "NUM_THREADS", "columns_per_cta", "gated_activation_launch",
           "gated_activation_spec", "specializations"]

#: Threads per CTA (whole warps and wavefronts).
NUM_THREADS = 256
#: The kernel's ``activation`` parameter by name (hal_core.ops.gated_activation.ACTIVATIONS).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def gated_activation_spec(dtype: str | int, warp_size: int = 32) -> Specialization:
    """``gated_activation.cu`` for one dtype at ``warp_size`` lanes."""
    return Specialization("gated_activation.cu", ("hal_gated_activation",),
                          (("HAL_DTYPE", str(dtype_code(dtype))), warp_define(warp_size)))


def columns_per_cta(dtype: str | int) -> int:
    """Columns one CTA takes: a 16-byte vector per thread."""
    return NUM_THREADS * (16 // ELEM_BYTES[dtype_code(dtype)])


def gated_activation_launch(num_tokens: int, intermediate_size: int, dtype: str | int) -> Launch:
    """grid (num_tokens, column blocks, 1): every CTA takes :func:`columns_per_cta` columns of one row."""
    return Launch("hal_gated_activation", (num_tokens, -(-intermediate_size // columns_per_cta(dtype)), 1),
                  (NUM_THREADS, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``gated_activation`` may request at ``warp_size`` lanes (one per dtype)."""
    return [gated_activation_spec(dtype, warp_size) for dtype in DTYPE_CODES]
