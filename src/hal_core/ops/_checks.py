"""Argument checks shared by every op: each error names the argument, expected and actual."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import dtype_name, is_c_contiguous

__all__ = ["check_array", "fail"]


def fail(arg: str, expected: str, actual: Any) -> ArgumentError:
    """An ArgumentError in the common format."""
    return ArgumentError(f"argument {arg!r}: expected {expected}, got {actual}")


def check_array(
    arg: str,
    value: Any,
    *,
    layout: str,
    ndim: int,
    dtypes: Iterable[str],
    contiguous: bool = True,
) -> str:
    """Check rank, dtype and contiguity of ``value``; return its dtype name.

    ``layout`` names the dimensions for the message, e.g. ``'[num_seqs, num_heads, head_size]'``.
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
    if contiguous and not is_c_contiguous(value):
        raise ArgumentError(
            f"argument {arg!r}: expected a C-contiguous array, got strides "
            f"{getattr(value, 'strides', '?')}; pass a contiguous copy (e.g. ascontiguousarray)"
        )
    return name
