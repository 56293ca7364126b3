"""Whether two strided views of one buffer share an element, exactly, whatever their shapes.

:func:`~hal_core.ops._checks.check_disjoint` is exact for two arrays of one shape and strides (the K and V
halves of a cache); the query and key slices of a fused QKV projection have one set of strides but different
head counts, and their extents interleave token by token. :func:`check_views_disjoint` decides those exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ArgumentError
from ..arrays import untag
from ._checks import byte_range, check_disjoint

__all__ = ["check_views_disjoint"]


def check_views_disjoint(first: str, a: Any, second: str, b: Any) -> None:
    """Refuse two arrays that share an element (an ``ArgumentError`` naming both); exact for equal strides."""
    if type(a) is np.ndarray and type(b) is np.ndarray and a is not b and not (
            a.size and b.size and np.may_share_memory(a, b)):
        return  # host arrays whose extents do not meet (separate buffers): numpy's bounds check decides
    strides_a, strides_b = _strides(a), _strides(b)
    if strides_a is None or strides_a != strides_b or tuple(a.shape) == tuple(b.shape) or a is b:
        check_disjoint(first, a, second, b)
        return
    ra, rb = byte_range(a), byte_range(b)
    if ra is None or rb is None or not (ra[0] < rb[1] and rb[0] < ra[1]):
        return
    itemsize = getattr(untag(a), "dtype", np.dtype(np.uint8)).itemsize
    low_a = sum(min(0, (n - 1) * s) for n, s in zip(a.shape, strides_a, strict=True))
    low_b = sum(min(0, (n - 1) * s) for n, s in zip(b.shape, strides_b, strict=True))
    delta = (rb[0] - low_b) - (ra[0] - low_a)  # first element of b minus first element of a, in bytes
    if _meet(delta, tuple(a.shape), tuple(b.shape), strides_a, itemsize):
        raise ArgumentError(f"arguments {first!r} and {second!r} overlap in memory; pass separate arrays")


def _strides(value: Any) -> tuple[int, ...] | None:
    strides = getattr(untag(value), "strides", None)
    return None if strides is None else tuple(int(x) for x in strides)


def _meet(delta: int, shape_a: tuple[int, ...], shape_b: tuple[int, ...], strides: tuple[int, ...],
          itemsize: int) -> bool:
    """Whether ``sum(s_k * (i_k - j_k)) = delta`` within an element for some ``0 <= i_k < a_k``, ``0 <= j_k < b_k``.

    Searched dimension by dimension, largest stride first, keeping only the differences the smaller dimensions
    can still reach (one or two per dimension for nested strides).
    """
    dims = sorted(((abs(s), (na - 1, nb - 1) if s >= 0 else (nb - 1, na - 1))
                   for s, na, nb in zip(strides, shape_a, shape_b, strict=True) if s and (na > 1 or nb > 1)),
                  reverse=True)
    # offset(a) - offset(b) = delta with d_k = i_k - j_k in [-(b_k - 1), a_k - 1] (sides swap for negative strides)
    reach_low, reach_high = [0], [0]
    for stride, (up, down) in reversed(dims):
        reach_low.append(reach_low[-1] + stride * down)
        reach_high.append(reach_high[-1] + stride * up)
    reach_low.reverse()
    reach_high.reverse()

    def search(k: int, rest: int) -> bool:
        if k == len(dims):
            return abs(rest) < itemsize
        stride, (up, down) = dims[k]
        # rest - d * stride must stay within [-reach_low[k+1] - itemsize, reach_high[k+1] + itemsize]
        low = max(-down, -((reach_high[k + 1] + itemsize - rest) // stride))
        high = min(up, (rest + reach_low[k + 1] + itemsize) // stride)
        return any(search(k + 1, rest - d * stride) for d in range(low, high + 1))

    return search(0, delta)
