"""The numpy fallback of ``quantized_gemm``, used only where the compiled kernels failed to load.

Columns are dequantised in bounded tiles (never the whole weight) and
multiplied with BLAS; W8A8 and W4A8 quantise the activations with
:func:`~hal_core.quant.quantize_activations` and sums each group's integer
products exactly in float64.
"""

from __future__ import annotations

import numpy as np

from hal_core.quant import QuantizedWeight, quantize_activations, unpack_int4

from ._fallback_attention import to_float32

__all__ = ["TILE_COLUMNS", "gemm"]

#: Columns dequantised at a time.
TILE_COLUMNS = 256


def _tile(qweight: QuantizedWeight, n0: int, n1: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Centred codes ``q - z`` and per-row scales of columns ``n0:n1``, both ``dtype`` ``[K, n1 - n0]``."""
    packed = np.asarray(qweight.qweight)[:, n0:n1]
    codes: np.ndarray = (unpack_int4(packed) if qweight.bits == 4 else packed).astype(dtype)
    groups = qweight.group_index()
    zeros = dtype(qweight.default_zero) if qweight.zeros is None else \
        np.asarray(qweight.zeros)[:, n0:n1].astype(dtype)[groups]
    scales = to_float32(np.asarray(qweight.scales)[:, n0:n1]).astype(dtype)[groups]
    return codes - zeros, scales


def gemm(x: np.ndarray, qweight: QuantizedWeight, *, int8_activations: bool = False) -> np.ndarray:
    """``x @ W`` as float32 ``[M, N]``; with int8 activations (W8A8, or W4A8 by ``int8_activations``) rows of x
    holding NaN or inf give NaN rows, as the compiled kernels do."""
    m = x.shape[0]
    n = qweight.shape[1]
    y = np.empty((m, n), dtype=np.float32)
    if qweight.bits == 8 or int8_activations:
        x32 = to_float32(np.ascontiguousarray(x))
        bad = ~np.isfinite(x32).all(axis=1)
        xq, sx = quantize_activations(np.where(bad[:, None], np.float32(0), x32))  # bad rows become NaN below
        groups = qweight.group_index()
        xq64 = xq.astype(np.float64)
        for n0 in range(0, n, TILE_COLUMNS):
            centred, scales = _tile(qweight, n0, min(n, n0 + TILE_COLUMNS), np.float64)
            acc = np.zeros((m, centred.shape[1]))
            for g in range(qweight.shape[0] // qweight.group_size):  # exact integer sums per group
                rows = np.flatnonzero(groups == g)
                if rows.size:
                    acc += (xq64[:, rows] @ centred[rows]) * scales[rows[0]]
            y[:, n0:n0 + centred.shape[1]] = acc * sx[:, None]
        y[bad] = np.nan
        return y
    x32 = to_float32(np.ascontiguousarray(x))
    for n0 in range(0, n, TILE_COLUMNS):
        centred, scales = _tile(qweight, n0, min(n, n0 + TILE_COLUMNS), np.float32)
        y[:, n0:n0 + centred.shape[1]] = x32 @ (centred * scales)
    return y
