"""Argument checks shared by every op: each error names the argument, expected and actual."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import dtype_name, is_c_contiguous, untag

__all__ = ["byte_range", "check_array", "check_disjoint", "check_writable", "fail", "host_index_checks"]


def fail(arg: str, expected: str, actual: Any) -> ArgumentError:
    """An ArgumentError in the common format."""
    return ArgumentError(f"argument {arg!r}: expected {expected}, got {actual}")


def host_index_checks(*arrays: Any) -> bool:
    """Whether validation checks these index arrays' values on the host, now, before any work.

    Only host (numpy) arrays, and only with ``HAL_CHECK_INDICES`` on (the
    default). Device arrays are never read back by an op call: the kernels
    check the values they use, never dereference one out of range, and
    record the argument in a device error flag that hal raises as
    :class:`~hal_core.ArgumentError` at its next synchronisation point or
    :func:`hal_core.check_errors` (docs/environment.md).
    """
    from .. import _env

    return _env.check_indices() and all(type(a) is np.ndarray for a in arrays)


def check_array(
    arg: str,
    value: Any,
    *,
    layout: str,
    ndim: int,
    dtypes: Iterable[str],
    contiguous: bool | Literal["last"] = True,
) -> str:
    """Check rank, dtype and layout of ``value``; return its dtype name.

    ``layout`` names the dimensions for the message, e.g. ``'[num_seqs, num_heads, head_size]'``.
    ``contiguous``: True requires a C-contiguous array; ``"last"`` only a
    contiguous last dimension and non-negative strides (views such as the
    key slice of a fused QKV projection); False checks no layout.
    """
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ArgumentTypeError(
            f"argument {arg!r}: expected an array {layout}, got {type(value).__name__}"
        )
    allowed = tuple(dtypes)
    name = dtype_name(value)
    if name not in allowed:
        raise ArgumentTypeError(
            f"argument {arg!r}: expected dtype {' or '.join(allowed)}, got {name}"
        )
    if len(value.shape) != ndim:
        raise fail(arg, f"{ndim} dimensions {layout}", f"shape {tuple(value.shape)}")
    if contiguous == "last":
        _check_rows_contiguous(arg, value)
    elif contiguous and not is_c_contiguous(value):
        raise ArgumentError(
            f"argument {arg!r}: expected a C-contiguous array, got strides "
            f"{getattr(value, 'strides', '?')}; pass a contiguous copy (e.g. ascontiguousarray)"
        )
    return name


def _strides(value: Any) -> tuple[int, ...] | None:
    """Byte strides of ``value`` (its storage's, for a tagged array), or None when it has none."""
    strides = getattr(untag(value), "strides", None)
    return None if strides is None else tuple(int(x) for x in strides)


def _check_rows_contiguous(arg: str, value: Any) -> None:
    if is_c_contiguous(value):
        return
    strides = _strides(value)
    itemsize = getattr(untag(value), "dtype", np.dtype(np.uint8)).itemsize
    shape = tuple(value.shape)
    if strides is None or (shape[-1] > 1 and strides[-1] != itemsize) or any(
        x < 0 for x, size in zip(strides, shape, strict=True) if size > 1
    ):
        raise ArgumentError(
            f"argument {arg!r}: expected a contiguous last dimension and non-negative strides, got strides "
            f"{strides if strides is not None else '?'} (bytes) for shape {shape}; pass a contiguous copy"
        )


def check_writable(arg: str, value: Any) -> None:
    """Refuse a read-only array (numpy's ``writeable`` flag) that an op would write."""
    flags = getattr(untag(value), "flags", None)
    writeable = getattr(flags, "writeable", None)
    if writeable is None and flags is not None:
        try:
            writeable = flags["WRITEABLE"]
        except (KeyError, TypeError):
            writeable = None
    if writeable is False:
        raise ArgumentError(f"argument {arg!r} is read-only; pass a writable array (e.g. a copy)")


def byte_range(value: Any) -> tuple[int, int] | None:
    """``[start, end)`` of the memory ``value`` spans, or None if unknown or empty.

    Read from a CuPy-style ``data.ptr`` with ``strides``, else from
    ``__array_interface__`` (arrays reach validation as the backend's own type): attributes only,
    no synchronisation and no copy.
    """
    storage = untag(value)
    # numpy's .data is a memoryview (and refuses float16): numpy arrays go through __array_interface__
    pointer = None if isinstance(storage, np.ndarray) else getattr(getattr(storage, "data", None), "ptr", None)
    if isinstance(pointer, int) and hasattr(storage, "strides"):
        shape, strides = tuple(storage.shape), tuple(storage.strides)
        itemsize = storage.dtype.itemsize
    else:
        interface = getattr(storage, "__array_interface__", None)
        if not isinstance(interface, dict):
            return None
        shape, pointer = tuple(interface["shape"]), int(interface["data"][0])
        itemsize = np.dtype(interface["typestr"]).itemsize
        given = interface.get("strides")
        if given is not None:
            strides = tuple(given)
        else:  # C-contiguous
            step, dense = itemsize, list[int]()
            for size in reversed(shape):
                dense.insert(0, step)
                step *= size
            strides = tuple(dense)
    if any(size == 0 for size in shape):
        return None
    low = pointer + sum(min(0, (size - 1) * stride) for size, stride in zip(shape, strides, strict=True))
    high = pointer + sum(max(0, (size - 1) * stride) for size, stride in zip(shape, strides, strict=True)) + itemsize
    return low, high


def check_disjoint(first: str, a: Any, second: str, b: Any) -> None:
    """Refuse two arrays (on one device) whose memory overlaps, e.g. one array given as both caches."""
    if a is b or untag(a) is untag(b):
        raise ArgumentError(f"arguments {first!r} and {second!r} are the same array; pass two separate arrays")
    if type(a) is np.ndarray and type(b) is np.ndarray:  # numpy's own extent check, in C (the hot path on a host)
        if a.size and b.size and np.may_share_memory(a, b):
            raise ArgumentError(f"arguments {first!r} and {second!r} overlap in memory; pass two separate arrays")
        return
    ra, rb = byte_range(a), byte_range(b)
    if ra is not None and rb is not None and ra[0] < rb[1] and rb[0] < ra[1]:
        raise ArgumentError(f"arguments {first!r} and {second!r} overlap in memory; pass two separate arrays")
