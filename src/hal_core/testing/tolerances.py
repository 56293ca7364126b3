"""The one table of tolerances the contract suite compares with: ``(atol, rtol)`` per op kind and dtype.

Inputs are drawn so results are O(1) (see :mod:`hal_core.testing.inputs`);
the backend and the float64 reference then see the same rounded inputs, so
the error is the output's rounding (fp16 eps 2**-11, bf16 eps 2**-8) plus
float32 accumulation, with headroom for reduced-precision intermediates a
GPU kernel may use (fp16/bf16 probabilities before the P @ V product).
"""

from __future__ import annotations

__all__ = ["TOLERANCES", "tolerance"]

TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    # softmax-weighted averages of V rows: |out| <= max |v|
    "attention": {"fp32": (1e-5, 1e-4), "fp16": (2e-3, 1e-2), "bf16": (1.6e-2, 2e-2)},
    # sums of K products of O(1/sqrt(K)) terms; scales stored in fp16
    "gemm": {"fp32": (1e-4, 1e-4), "fp16": (2e-3, 1e-2), "bf16": (1.6e-2, 2e-2)},
    # a copy: bit-exact
    "copy": {"fp32": (0.0, 0.0), "fp16": (0.0, 0.0), "bf16": (0.0, 0.0)},
    # a row or element computed in float32 and rounded once to the dtype (rms_norm, gated_activation)
    "elementwise": {"fp32": (1e-5, 1e-5), "fp16": (1e-3, 2e-3), "bf16": (8e-3, 1e-2)},
    # a rotation of O(1) pairs in float32, rounded once to the dtype (half an ulp: 2**-11 relative in fp16, 2**-9 bf16)
    "rotary": {"fp32": (1e-6, 1e-5), "fp16": (1e-5, 1e-3), "bf16": (1e-4, 8e-3)},
    # fused_moe with int8 (W8A8) experts: the gated intermediate is quantized per token again, and a value within
    # float32 rounding of a code boundary takes the neighbouring code in the kernel, moving each output it feeds
    # by up to max|intermediate| / 127 * |w2| (about 1 % of the output's scale per flipped code)
    "moe_w8a8": {"fp32": (4e-3, 2e-2), "fp16": (1e-2, 2e-2), "bf16": (2e-2, 3e-2)},
}


def tolerance(kind: str, dtype: str) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing an op of ``kind`` in ``dtype`` with its float64 reference."""
    return TOLERANCES[kind][dtype]
