"""The layout checks behind the ops: memory extents of numpy, CuPy-style and interface-only arrays, aliasing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hal_core import ArgumentError
from hal_core.arrays import TaggedArray
from hal_core.ops import _checks
from hal_core.ops._checks import byte_range, check_disjoint, check_writable


def _extent(a: np.ndarray) -> tuple[int, int]:
    """Independent: the lowest and one past the highest byte of every element."""
    base = a.__array_interface__["data"][0]
    offsets = [base + sum(i * s for i, s in zip(idx, a.strides, strict=True)) for idx in np.ndindex(a.shape)]
    return min(offsets), max(offsets) + a.itemsize


@pytest.mark.parametrize("view", ["whole", "reversed", "transposed", "rows", "every-other", "fp16"])
def test_byte_range_of_numpy_views(view: str) -> None:
    """The extent of a view is exactly the bytes its elements occupy, whatever the strides."""
    a = np.arange(60, dtype=np.float32).reshape(5, 12)
    v = {"whole": a, "reversed": a[::-1, ::-1], "transposed": a.T, "rows": a[1:3], "every-other": a[:, ::2],
         "fp16": a.astype(np.float16)[2:]}[view]
    assert byte_range(v) == _extent(v)


def _device_like(a: np.ndarray) -> Any:
    """A CuPy-style array: data.ptr, shape, strides, dtype, no __array_interface__."""
    return SimpleNamespace(data=SimpleNamespace(ptr=a.__array_interface__["data"][0]), shape=a.shape,
                           strides=a.strides, dtype=a.dtype)


def _interface_only(a: np.ndarray) -> Any:
    """An object exposing only __cuda_array_interface__ (strides None: C-contiguous)."""
    interface = dict(a.__array_interface__)
    if a.flags.c_contiguous:
        interface["strides"] = None
    return SimpleNamespace(__cuda_array_interface__=interface, shape=a.shape, dtype=a.dtype)


def test_byte_range_without_numpy() -> None:
    """Device-style data.ptr/strides give numpy's extents; a tag is looked through; a device interface alone gives None.

    Arrays reach validation as the backend's own type, which exposes ``data.ptr``; hal-core reads no
    vendor-named protocol, so an array exposing only a device interface is not range-checked (None).
    """
    a = np.zeros((4, 8), np.uint16)
    for v in (a, a[1:], a[:, 3:]):
        assert byte_range(_device_like(v)) == _extent(v)
        assert byte_range(_interface_only(v)) is None
    assert byte_range(TaggedArray(_device_like(a), "bf16")) == _extent(a)
    assert byte_range(np.zeros((0, 4))) is None and byte_range(object()) is None


def test_check_disjoint() -> None:
    """Same array, overlapping views and device-like overlaps are refused naming both; disjoint halves pass."""
    a = np.zeros((8, 4), np.float32)
    check_disjoint("key_cache", a[:4], "value_cache", a[4:])
    for first, second in [(a, a), (a[:5], a[4:]), (_device_like(a[:5]), _device_like(a[3:]))]:
        with pytest.raises(ArgumentError, match="'key_cache' and 'value_cache'"):
            check_disjoint("key_cache", first, "value_cache", second)


@pytest.mark.parametrize("way", ["numpy-solver", "own-search", "device"])
@pytest.mark.parametrize("shape", [(6, 2, 16, 128), (3, 1, 4, 32), (5, 4, 1, 8)])
def test_check_disjoint_interleaved_halves(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...],
                                           way: str) -> None:
    """An engine's K and V halves of one cache (``[..., 2 * block, head]``) pass, whichever test answers (numpy's
    solver; hal's own where the solver gives up, work bound 0; hal's own for device-style arrays), twice (the
    second answer kept from the first); halves shifted by one row share memory and are refused, twice."""
    if way == "own-search":
        monkeypatch.setattr(_checks, "_OVERLAP_WORK", 0)
    view = _device_like if way == "device" else (lambda a: a)
    blocks, heads, block, width = shape
    halves = np.zeros(shape, np.float16).reshape(blocks, heads, 2 * block, width // 2)
    key, value = view(halves[:, :, :block]), view(halves[:, :, block:])
    for _ in range(2):
        check_disjoint("key_cache", key, "value_cache", value)
    if block > 1:
        shifted = view(halves[:, :, block - 1:2 * block - 1])
        for _ in range(2):
            with pytest.raises(ArgumentError, match="overlap in memory"):
                check_disjoint("key_cache", key, "value_cache", shifted)


def test_check_writable() -> None:
    """A read-only numpy array is refused naming it; arrays without a writeable flag pass."""
    a = np.zeros(3)
    check_writable("key_cache", a)
    a.flags.writeable = False
    with pytest.raises(ArgumentError, match="'key_cache' is read-only"):
        check_writable("key_cache", a)
    check_writable("key_cache", _device_like(np.zeros(3)))
