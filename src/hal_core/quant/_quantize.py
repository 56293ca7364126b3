"""Quantising float weights and activations (the formats in :mod:`hal_core.quant`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import BFLOAT16
from ._args import as_bool, as_int
from ._weight import QuantizedWeight, pack_int4
from .gptq import host_numpy

__all__ = ["quantize", "quantize_activations"]


#: dtypes ``quantize`` stores scales in (the ones ``quantized_gemm`` reads).
SCALE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(BFLOAT16))


def quantize(
    w: Any,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: Any = np.float16,
) -> QuantizedWeight:
    """Quantise real weights ``w [K, N]`` group-wise along K (host numpy out).

    ``w`` may be any 2-D real array (float or integer; numpy, CuPy or torch,
    any strides: ``quantize(linear.weight.T)`` is the natural call for a
    torch ``nn.Linear``); every returned array is C-contiguous.

    Symmetric: ``s = max|w| / (2**(bits-1) - 1)``, ``z = 2**(bits-1)``.
    Asymmetric: ``s = (max - min) / (2**bits - 1)``, ``z = round(-min / s)``.
    Codes are ``clip(round(w / s) + z, 0, 2**bits - 1)``; scales are rounded
    to ``scale_dtype`` (float16, bfloat16 or float32) first, so
    :meth:`QuantizedWeight.dequantize` is exact with respect to the stored values.
    """
    bits = as_int("bits", bits)
    if bits not in (4, 8):
        raise ValueError(f"argument 'bits': expected 4 or 8, got {bits!r}")
    group_size = as_int("group_size", group_size)
    symmetric = bool(as_bool("symmetric", symmetric))
    try:
        scale_dtype = np.dtype(scale_dtype)
    except TypeError:
        raise TypeError(f"argument 'scale_dtype': expected a dtype, got {scale_dtype!r}") from None
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"argument 'scale_dtype': expected float16, bfloat16 or float32, got {scale_dtype}")
    w = host_numpy("w", w)
    if w.dtype != BFLOAT16 and w.dtype.kind not in "fiu":
        raise TypeError(f"argument 'w': expected real (floating-point or integer) weights, got dtype {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"argument 'w': expected 2 dimensions [K, N], got shape {w.shape}")
    k, n = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"argument 'group_size': expected a positive divisor of K={k}, got {group_size}")
    if bits == 4 and k % 8:
        raise ValueError(f"argument 'w': int4 packing needs K divisible by 8, got K={k}")
    w64 = np.ascontiguousarray(w, dtype=np.float64).reshape(k // group_size, group_size, n)
    if not np.isfinite(w64).all():
        raise ValueError("argument 'w': weights must be finite")
    qmax = (1 << bits) - 1
    if symmetric:
        zero = 1 << (bits - 1)
        scale = np.abs(w64).max(axis=1) / (zero - 1)
        zeros = None
    else:
        lo, hi = np.minimum(w64.min(axis=1), 0.0), np.maximum(w64.max(axis=1), 0.0)
        scale = (hi - lo) / qmax
    scale = np.where(scale > 0, scale, 1.0).astype(scale_dtype)
    if not np.isfinite(scale.astype(np.float64)).all() or (scale == 0).any():
        raise ValueError(f"argument 'scale_dtype': {np.dtype(scale_dtype)} cannot represent these scales; "
                         "use np.float32")
    s64 = scale.astype(np.float64)
    if symmetric:
        z64: Any = float(zero)
    else:
        zeros = np.ascontiguousarray(np.clip(np.rint(-lo / s64), 0, qmax).astype(np.uint8))
        z64 = zeros.astype(np.float64)[:, None, :]
    codes = np.clip(np.rint(w64 / s64[:, None, :]) + z64, 0, qmax).astype(np.uint8).reshape(k, n)
    qweight = pack_int4(codes) if bits == 4 else codes
    return QuantizedWeight(qweight=np.ascontiguousarray(qweight), scales=np.ascontiguousarray(scale),
                           zeros=zeros, bits=bits, group_size=group_size, shape=(k, n))


def quantize_activations(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-token int8 quantisation used by W8A8: ``(xq int8 [M, K], sx float32 [M])``.

    Computed in float32 (``x`` is widened first, so fp16/bf16 inputs give
    the same scales on every backend): ``sx[m] = max|x[m]| / 127``, at least
    the smallest float32 subnormal (so a row of subnormals never gets a zero
    scale), and 1 for an all-zero row; ``xq = clip(rint(x / sx), -127, 127)``
    (round half to even), so ``x ~ xq * sx``.

    A row holding any NaN or infinity has no int8 representation: its
    ``sx[m]`` is NaN and its ``xq[m]`` is all zeros, so the W8A8 product
    ``sx[m] * (xq[m] @ w)`` makes that whole output row NaN, on every
    backend (docs/quantization.md).
    """
    x32 = np.asarray(x).astype(np.float32)
    if x32.ndim != 2:
        raise ValueError(f"argument 'x': expected 2 dimensions [M, K], got shape {x32.shape}")
    finite = np.asarray(np.isfinite(x32).all(axis=1), dtype=bool)
    x32 = np.where(finite[:, None], x32, np.float32(0.0))
    amax = np.abs(x32).max(axis=1) if x32.shape[1] else np.zeros(x32.shape[0], np.float32)
    tiny = np.finfo(np.float32).smallest_subnormal
    sx = np.where(amax > 0, np.maximum(amax / np.float32(127.0), tiny), np.float32(1.0)).astype(np.float32)
    xq = np.clip(np.rint(x32 / sx[:, None]), -127, 127).astype(np.int8)
    sx[~finite] = np.float32(np.nan)
    return xq, sx
