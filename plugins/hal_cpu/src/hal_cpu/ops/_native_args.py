"""Turning numpy arrays into the compiled kernels' arguments: dtype codes, element strides, pointers, structs."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from hal_core.arrays import BFLOAT16

from .._native import pointer as pointer_of

__all__ = ["DTYPE_CODES", "dtype_code", "element_strides", "fill_struct", "last_contiguous"]

_Struct = TypeVar("_Struct", bound=ctypes.Structure)

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


def fill_struct(struct: type[_Struct], values: Mapping[str, Any]) -> _Struct:
    """An argument struct of the kernels with every field taken from ``values`` by name: a numpy array becomes
    its data pointer (the caller keeps it alive for the call), None a null pointer or 0, a number its C type.

    A field ``values`` does not name is a TypeError naming it (never a silent 0); so is a name no field has.
    """
    plan = _PLANS.get(struct)
    if plan is None:
        plan = _PLANS[struct] = _plan(struct)
    names, fields, pointers, numbers = plan
    if values.keys() != names:
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"{struct.__name__}: no field(s) {sorted(unknown)}")
        missing = next(name for name, _, _ in fields if name not in values)
        raise TypeError(f"{struct.__name__}: field {missing!r} not given")
    filled = dict(values)
    for name in pointers:  # arrays become addresses; ctypes itself converts ints, floats, None pointers and
        value = filled[name]  # numpy scalars, as the full pass below would
        if type(value) is np.ndarray:
            filled[name] = pointer_of(value)
    for name in numbers:
        if filled[name] is None:
            filled[name] = 0
    try:
        return struct(**filled)
    except TypeError:  # a float for an integer field, an array for a number: converted one field at a time
        return _converted(struct, fields, values)


def _converted(struct: type[_Struct], fields: tuple[tuple[str, bool, bool], ...], values: Mapping[str, Any]) -> _Struct:
    """:func:`fill_struct`'s every field converted by its kind: None a null pointer or 0, a number its C type."""
    filled: dict[str, Any] = {}
    for name, pointer, floating in fields:
        value = values[name]
        kind = type(value)
        if kind is int or (kind is float and floating):
            filled[name] = value
        elif kind is np.ndarray:
            filled[name] = pointer_of(value)
        elif value is None:
            filled[name] = None if pointer else 0
        else:
            filled[name] = value if pointer else float(value) if floating else int(value)
    return struct(**filled)


#: Per struct: its field names, (name, is a pointer, is a float) per field in order, its pointer fields and its
#: number fields; made at first use.
_PLANS: dict[type, tuple[frozenset[str], tuple[tuple[str, bool, bool], ...], tuple[str, ...], tuple[str, ...]]] = {}


def _plan(struct: type[ctypes.Structure]) -> tuple[frozenset[str], tuple[tuple[str, bool, bool], ...],
                                                   tuple[str, ...], tuple[str, ...]]:
    fields = tuple((entry[0], entry[1] is ctypes.c_void_p, entry[1] in (ctypes.c_float, ctypes.c_double))
                   for entry in struct._fields_)
    return (frozenset(name for name, _, _ in fields), fields, tuple(name for name, pointer, _ in fields if pointer),
            tuple(name for name, pointer, _ in fields if not pointer))
