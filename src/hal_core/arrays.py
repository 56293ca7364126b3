"""Array-library-agnostic helpers: dtype names, devices and contiguity.

Arrays are recognised by protocol (``__dlpack_device__``, ``flags``,
``shape``/``dtype``), never by importing a vendor library.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

__all__ = [
    "ArrayLike",
    "BFLOAT16",
    "TaggedArray",
    "device_of",
    "dtype_name",
    "is_c_contiguous",
    "numpy_dtype",
    "untag",
]

#: numpy's bfloat16 dtype (from ml_dtypes).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_NAMES = {
    np.dtype(np.float64): "fp64",
    np.dtype(np.float32): "fp32",
    np.dtype(np.float16): "fp16",
    BFLOAT16: "bf16",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.uint32): "uint32",
}
_BY_NAME = {name: dtype for dtype, name in _NAMES.items()}

# DLPack device types (dlpack.h): CPU, CUDA, CUDA host, ROCm, ...
_DLPACK_KINDS = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm", 13: "cuda_managed",
}


@runtime_checkable
class ArrayLike(Protocol):
    """What hal needs of an array: a shape and a dtype."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...


def dtype_name(array_or_dtype: Any) -> str:
    """hal's name for a dtype (``'fp16'``, ``'bf16'``, ``'int32'`` ...).

    Arrays tagged with a ``hal_dtype`` attribute (16-bit storage carrying
    bf16, for example) report the tag.
    """
    tag = getattr(array_or_dtype, "hal_dtype", None)
    if isinstance(tag, str):
        return tag
    dtype = getattr(array_or_dtype, "dtype", array_or_dtype)
    try:
        return _NAMES.get(np.dtype(dtype), str(np.dtype(dtype)))
    except TypeError:
        return str(dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a hal dtype name; ``'bf16'`` is ml_dtypes' bfloat16."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {sorted(_BY_NAME)}") from None


def device_of(array: Any) -> tuple[str, int]:
    """``(kind, index)`` of the memory holding ``array``, e.g. ``('cpu', 0)`` or ``('cuda', 1)``."""
    probe = getattr(array, "__dlpack_device__", None)
    if probe is None:
        return ("cpu", 0) if isinstance(array, np.ndarray) else ("unknown", 0)
    kind, index = probe()
    return (_DLPACK_KINDS.get(int(kind), f"dlpack{int(kind)}"), int(index))


def is_c_contiguous(array: Any) -> bool:
    """Whether ``array`` is C-contiguous (row-major with no gaps)."""
    flags = getattr(array, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            return bool(getattr(flags, "c_contiguous", False))
    method = getattr(array, "is_contiguous", None)
    return bool(method()) if callable(method) else False


class TaggedArray:
    """An array whose library lacks its dtype, carried as same-width storage plus a tag.

    CuPy has no bfloat16, so bf16 device data travels as a uint16 CuPy array
    tagged ``'bf16'``; kernels read the bits as bf16, nothing is converted.
    ``shape``, ``dtype`` (the storage's), ``flags`` and the DLPack device
    come from the storage; :func:`untag` returns it.
    """

    __slots__ = ("hal_dtype", "storage")

    def __init__(self, storage: Any, hal_dtype: str) -> None:
        self.storage = storage
        self.hal_dtype = hal_dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.storage.shape)

    @property
    def dtype(self) -> Any:
        return self.storage.dtype

    @property
    def flags(self) -> Any:
        return self.storage.flags

    @property
    def size(self) -> int:
        return int(self.storage.size)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.storage.__dlpack_device__()

    def __getitem__(self, index: Any) -> TaggedArray:
        return TaggedArray(self.storage[index], self.hal_dtype)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.storage[index] = untag(value)

    def __repr__(self) -> str:
        return f"TaggedArray({self.hal_dtype}, shape={self.shape}, storage={type(self.storage).__name__})"


def untag(array: Any) -> Any:
    """The storage of a :class:`TaggedArray`; any other array unchanged."""
    return array.storage if isinstance(array, TaggedArray) else array
