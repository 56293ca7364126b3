"""W4A16's ``'tiles'`` kernel: dequantised ``[K, columns]`` tiles of the weight, one at a time, times BLAS."""

from __future__ import annotations

import ctypes

import numpy as np

from hal_core.quant import QuantizedWeight

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, fill_struct

__all__ = ["tiles"]


def tiles(native: _native.Native, x: np.ndarray, xs: int, qweight: QuantizedWeight, qw: np.ndarray,
          scales: np.ndarray, zeros: np.ndarray | None, g_idx: np.ndarray | None, y: np.ndarray,
          tile_bytes: int | None, threads: int) -> int:
    """Dequantise ``[K, columns]`` tiles one at a time and multiply each with BLAS into ``y``."""
    m, k = x.shape
    n = y.shape[1]
    ptr = _native.pointer
    x32 = x if x.dtype == np.float32 and x.flags.c_contiguous else np.empty((m, k), dtype=np.float32)
    if x32 is not x:
        widen = fill_struct(_abi.ToFloat32Args, dict(x=ptr(x), x_stride=xs, m=m, k=k, out=ptr(x32),
                                                      dtype=dtype_code(x), threads=threads))
        native.lib.hal_cpu_to_float32(ctypes.byref(widen))
    columns = _rules.dequant_tile_columns(k, n, tile_bytes or _rules.DEQUANT_TILE_BYTES)
    tile = np.empty((k, columns), dtype=np.float32)
    part = np.empty((m, columns), dtype=np.float32)
    for n0 in range(0, n, columns):
        width = min(columns, n - n0)
        t = tile[:, :width] if width == columns else np.empty((k, width), dtype=np.float32)
        tile_args = fill_struct(_abi.DequantTileArgs, dict(
            qweight=ptr(qw), scales=ptr(scales), zeros=ptr(zeros), g_idx=ptr(g_idx), group_size=qweight.group_size,
            k=k, n=n, n0=n0, n1=n0 + width, out=ptr(t), ld=width, bits=qweight.bits, s_dtype=dtype_code(scales),
            default_zero=qweight.default_zero, threads=threads))
        native.lib.hal_cpu_dequant_tile(ctypes.byref(tile_args))
        out = part if width == columns else np.empty((m, width), dtype=np.float32)
        np.matmul(x32, t, out=out)
        y[:, n0:n0 + width] = out
    return 0
