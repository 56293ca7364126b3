"""Specialisations and pure launch rules of ``fused_moe``: ``fused_moe.cu``.

Plain Python (no CuPy, no driver); :mod:`hal_cupy.ops._fused_moe` calls them. A specialisation differs by the
hidden dtype, the experts' bits, int4 experts' activations (float: W4A16; int8: W4A8) and the SIMD width
(routing and activation are kernel parameters).
``hal_cupy/kernels/README.md`` documents the kernels' parameters.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, Launch, Specialization, dtype_code, warp_define
from ._gated_activation_rules import ACTIVATION_CODES

__all__ = ["ACTIVATION_CODES", "MOE_BITS", "MOE_FORMATS", "MOE_GROUP_SIZES", "MOE_KWARPS", "MOE_THREADS", "MOE_TILE",
           "ROUTING_CODES", "combine_launch", "gemm_kernels", "gemm_launch", "max_tiles", "moe_kernels",
           "moe_spec", "route_launch", "scatter_launch", "align_launch", "specializations"]

#: Rows per grouped-GEMM tile (the kernel's HAL_MOE_TILE default): each expert's rows are padded to it.
MOE_TILE = 8
#: Warps per grouped-GEMM CTA, splitting K (HAL_KWARPS).
MOE_KWARPS = 4
#: Threads of the routing, alignment, scatter and combine CTAs (HAL_MOE_ALIGN_THREADS).
MOE_THREADS = 256
#: Expert formats with a kernel.
MOE_BITS = (4, 8)
#: (bits, int8 activations) of every GEMM pair: W4A16, W4A8, W8A8.
MOE_FORMATS = ((4, False), (4, True), (8, True))
#: Group sizes the kernels serve (a group is a whole number of 8-row int4 words and of 4-row int8 words).
MOE_GROUP_SIZES = (32, 64, 128)
#: The route kernel's ``routing`` parameter by name (hal_core.ops.fused_moe.ROUTINGS).
ROUTING_CODES = {"softmax_topk": 0, "softmax_topk_renorm": 1, "topk_softmax": 2}


def gemm_kernels(bits: int, int8_activations: bool = False) -> tuple[str, str]:
    """The gate/up and down kernels for ``bits``-bit experts (``int8_activations``: int4 experts as W4A8; int8
    experts are always W8A8)."""
    name = "w4a8" if bits == 4 and int8_activations else f"w{bits}"
    return (f"hal_moe_{name}_gate_up", f"hal_moe_{name}_down")


def moe_kernels(bits: int, int8_activations: bool = False) -> tuple[str, ...]:
    """Every entry point of one specialisation, in pipeline order."""
    return ("hal_moe_route", "hal_moe_align", "hal_moe_scatter", *gemm_kernels(bits, int8_activations),
            "hal_moe_combine")


def moe_spec(dtype: str | int, bits: int, warp_size: int = 32, int8_activations: bool = False) -> Specialization:
    """``fused_moe.cu`` for hidden states of ``dtype`` and ``bits``-bit experts, at ``warp_size`` lanes
    (``int8_activations``: int4 experts as W4A8, ``HAL_ABITS=8``)."""
    if bits not in MOE_BITS:
        raise ValueError(f"bits must be one of {MOE_BITS}, got {bits}")
    w4a8 = bits == 4 and int8_activations
    return Specialization("fused_moe.cu", moe_kernels(bits, w4a8),
                          (("HAL_DTYPE", str(dtype_code(dtype))), ("HAL_QBITS", str(bits)),
                           *((("HAL_ABITS", "8"),) if w4a8 else ()), warp_define(warp_size)))


def max_tiles(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Row tiles of the worst case: every expert's rows padded to :data:`MOE_TILE`,
    ``ceil((num_tokens * top_k + num_experts * (MOE_TILE - 1)) / MOE_TILE)``; the surplus exits on device."""
    return -(-(num_tokens * top_k + num_experts * (MOE_TILE - 1)) // MOE_TILE)


def route_launch(num_tokens: int) -> Launch:
    """One thread per token."""
    return Launch("hal_moe_route", (max(1, -(-num_tokens // MOE_THREADS)), 1, 1), (MOE_THREADS, 1, 1))


def align_launch() -> Launch:
    """One CTA."""
    return Launch("hal_moe_align", (1, 1, 1), (MOE_THREADS, 1, 1))


def scatter_launch(num_pairs: int) -> Launch:
    """One thread per (token, slot) pair."""
    return Launch("hal_moe_scatter", (max(1, -(-num_pairs // MOE_THREADS)), 1, 1), (MOE_THREADS, 1, 1))


def gemm_launch(kernel: str, tiles: int, columns: int, warp_size: int) -> Launch:
    """grid (tiles, column blocks of 4 per lane): ``columns`` is the intermediate size (gate/up) or hidden (down)."""
    return Launch(kernel, (tiles, -(-columns // (4 * warp_size)), 1), (MOE_KWARPS * warp_size, 1, 1))


def combine_launch(num_tokens: int, hidden: int) -> Launch:
    """grid (tokens, column blocks): one output element per thread."""
    return Launch("hal_moe_combine", (num_tokens, -(-hidden // MOE_THREADS), 1), (MOE_THREADS, 1, 1))


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``fused_moe`` may request at ``warp_size`` lanes (per dtype, bits and, for int4
    experts, activations)."""
    return [moe_spec(dtype, bits, warp_size, int8) for dtype in DTYPE_CODES for bits, int8 in MOE_FORMATS]
