"""``quantized_gemm`` W4A8 on the host: int4 weights times activations quantised per token to int8.

The activations are quantised bit for bit as :func:`~hal_core.quant.quantize_activations`
(``sx = amax / 127`` per row, ``xq = rint(x / sx)`` half to even, clipped to [-127, 127]);
then ``y = sx * (xq @ dequantize(w))``. A row of ``x`` holding NaN or inf gives a row of NaN.

- Weights without act-order whose group size is a multiple of 8 (every GPTQ/AWQ export): the
  compiled integer kernel (csrc/w4a8.inl): codes times int8 activations summed exactly in int32
  per group (``vpdpbusd`` on AVX512_VNNI, the same integer sums in plain code elsewhere), then
  ``y += scale * float(sum - zero * sum(xq))`` group after group with one fused multiply-add, and
  the token scale last. Every ISA variant and thread count gives the same bits.
- Other weights (act-order ``g_idx``, group sizes not a multiple of 8): the integer activations
  (exact in float32) times dequantised tiles with BLAS (:func:`hal_cpu.ops._tiles.tiles`), then
  the token scale; float32 sums, so not bit-identical to the integer kernel.

Allocations per call: ``xq`` as float32 ``[M, K]`` and the token scales (tiles path), or the
kernel's ``M * K`` int8 panel and ``M * K / G`` int32 group sums; the float32 result.
"""

from __future__ import annotations

import numpy as np

from hal_core.quant import QuantizedWeight, quantize_activations

from .. import _native
from . import _rules
from ._tiles import tiles

__all__ = ["gemm"]


def gemm(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight, threads: int | None) -> np.ndarray:
    """W4A8 ``x [M, K]`` (last dimension contiguous) times an int4 ``qweight``, as float32 ``[M, N]``."""
    m, k = x.shape
    n = qweight.shape[1]
    if threads is None:
        threads = _rules.threads_for(qweight.nbytes + x.nbytes, native.threads)
    xq, sx = quantize_activations(x)  # a row holding NaN or inf: zeros and a NaN scale, so a NaN row below
    xqf = np.ascontiguousarray(xq, dtype=np.float32)
    qw, scales = np.asarray(qweight.qweight), np.asarray(qweight.scales)
    scales = scales if scales.dtype in (np.float32, np.float16) or scales.dtype.name == "bfloat16" else \
        scales.astype(np.float32)
    zeros = None if qweight.zeros is None else np.asarray(qweight.zeros)
    g_idx = None if qweight.g_idx is None else np.ascontiguousarray(qweight.g_idx, dtype=np.int32)
    y = np.empty((m, n), dtype=np.float32)
    tiles(native, xqf, k, qweight, qw, scales, zeros, g_idx, y, None, threads)
    y *= sx[:, None]
    return y
