"""Turning numpy arrays into the compiled kernels' arguments: dtype codes, element strides, pointers."""

from __future__ import annotations

import numpy as np

from hal_core.arrays import BFLOAT16

__all__ = ["DTYPE_CODES", "dtype_code", "element_strides", "last_contiguous"]

#: The kernels' dtype codes (csrc/hal_cpu_kernels.h: HAL_F32, HAL_F16, HAL_BF16).
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(BFLOAT16): 2}


def dtype_code(array: np.ndarray) -> int:
    """The kernel dtype code of a float32, float16 or bfloat16 array."""
    return DTYPE_CODES[array.dtype]


def last_contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` itself when its last dimension is contiguous and its strides are whole elements, else a copy."""
    item = array.itemsize
    if array.ndim and (array.strides[-1] != item and array.shape[-1] > 1):
        return np.ascontiguousarray(array)
    if any(s % item for s in array.strides):
        return np.ascontiguousarray(array)
    return array


def element_strides(array: np.ndarray) -> tuple[int, ...]:
    """Strides of ``array`` in elements (see :func:`last_contiguous`)."""
    item = array.itemsize
    return tuple(s // item for s in array.strides)
