"""Bringing foreign arrays (DLPack, ``__cuda_array_interface__``, torch) into an op and back.

:func:`import_arrays` is called by the ops front door before validation.
It returns the arguments in the backend's own array type and a function
that turns results back into the caller's kind of array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._backend import Backend
    from .ops import OpSpec

__all__ = ["import_arrays"]


def _identity(value: Any) -> Any:
    return value


def import_arrays(spec: OpSpec, args: dict[str, Any], backend: Backend) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Arguments as native arrays (no copy), plus the converter for the result."""
    return args, _identity
