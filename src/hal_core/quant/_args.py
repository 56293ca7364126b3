"""Argument checks shared by :func:`quantize`, :func:`from_gptq` and :func:`from_awq`.

Each error names the argument. Integers may be Python ints, numpy integer
scalars or 0-d integer arrays (anything ``operator.index`` takes), never
bools.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..arrays import BFLOAT16

__all__ = ["as_bool", "as_int", "require_finite", "require_integer_dtype"]


def _is_bool(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and (getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool")


def as_int(name: str, value: Any) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a 0-d integer array (not a bool)."""
    if type(value) is int:  # the common case, answered before the general checks
        return value
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"argument {name!r}: expected an integer, got {type(value).__name__} {value!r}")


def as_bool(name: str, value: Any, *, allow_none: bool = False) -> bool | None:
    """``value`` as a Python bool (``True``/``False`` or a numpy bool); None too when ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "b":
        return bool(value)
    expected = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"argument {name!r}: expected {expected}, got {type(value).__name__} {value!r}")


def require_integer_dtype(name: str, array: np.ndarray) -> None:
    """Refuse anything but signed or unsigned integers (floats, bools, complex ...)."""
    if array.dtype.kind not in "iu":
        raise TypeError(f"argument {name!r}: expected an integer array, got dtype {array.dtype}")


def require_finite(name: str, array: np.ndarray) -> None:
    """Refuse NaN or infinite values, pointing at the first one."""
    finite = np.isfinite(array.astype(np.float32) if array.dtype == BFLOAT16 else array)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"argument {name!r}: expected finite values, got {array[where]} at index {where}")
