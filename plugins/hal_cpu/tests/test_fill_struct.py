"""fill_struct: the kernels' argument structs filled by field name (arrays as pointers, None as null / 0)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hal_cpu.ops._native_args import fill_struct


class Args(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("count", ctypes.c_int32), ("scale", ctypes.c_float),
                ("extra", ctypes.c_void_p), ("window", ctypes.c_int32)]


def test_fields_come_from_the_mapping_by_name() -> None:
    """An array becomes its data pointer, None a null pointer or 0, numbers their C type."""
    array = np.arange(4, dtype=np.float32)
    filled = fill_struct(Args, {"window": None, "scale": 0.5, "data": array, "count": np.int64(4), "extra": None})
    assert filled.data == array.ctypes.data and filled.extra is None
    assert (filled.count, filled.scale, filled.window) == (4, 0.5, 0)


def test_a_missing_or_unknown_field_is_named() -> None:
    """A field left out, or a name the struct lacks, is a TypeError naming it (never a silent 0)."""
    with pytest.raises(TypeError, match="field 'window' not given"):
        fill_struct(Args, {"data": None, "count": 1, "scale": 1.0, "extra": None})
    with pytest.raises(TypeError, match=r"no field\(s\) \['softcap'\]"):
        fill_struct(Args, {"data": None, "count": 1, "scale": 1.0, "extra": None, "window": 2, "softcap": 3.0})


def test_every_value_kind_gives_the_full_conversions_result() -> None:
    """ctypes' own conversion (the common path) and the field-by-field one agree on every kind of value: numpy
    scalars, a whole float for an integer field, None for a number, an address as an int."""
    from hal_cpu.ops._native_args import _converted, _plan

    array = np.arange(3, dtype=np.int32)
    cases = [
        {"data": array, "count": np.int32(7), "scale": np.float64(0.25), "extra": 4096, "window": None},
        {"data": None, "count": 3.0, "scale": 2, "extra": array[1:], "window": np.int64(-1)},
        {"data": array, "count": True, "scale": np.float32(1.5), "extra": None, "window": 9},
    ]
    for values in cases:
        fast, full = fill_struct(Args, values), _converted(Args, _plan(Args)[1], values)
        assert bytes(fast) == bytes(full), values
