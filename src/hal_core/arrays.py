"""Array-library-agnostic helpers: dtype names, devices and contiguity.

Arrays are recognised by protocol (``__dlpack_device__``, ``flags``,
``shape``/``dtype``), never by importing a vendor library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "BFLOAT16",
    "DLPACK_CPU",
    "DLPACK_HOST_TYPES",
    "DTYPE_NAMES",
    "TaggedArray",
    "device_of",
    "dlpack_device",
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
#: hal's dtype names of numpy dtypes (a lookup for hot paths, not to be modified; :func:`dtype_name`
#: handles every array).
DTYPE_NAMES: Mapping[np.dtype, str] = _NAMES

#: DLPack's device type code of host memory (``kDLCPU``).
DLPACK_CPU = 1
#: DLPack device types whose memory is host memory (plain, and page-locked memory a device maps).
DLPACK_HOST_TYPES = frozenset({1, 3, 11})

# Names of the DLPack device types (dlpack.h's DLDeviceType enumerators), for messages.
_DLPACK_KINDS = {
    1: "cpu", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal", 9: "kDLVPI",
    10: "kDLROCM", 11: "kDLROCMHost", 12: "kDLExtDev", 13: "kDLCUDAManaged", 14: "kDLOneAPI", 15: "kDLWebGPU",
    16: "kDLHexagon", 17: "kDLMAIA",
}


def dtype_name(array_or_dtype: Any) -> str:
    """hal's name for a dtype (``'fp16'``, ``'bf16'``, ``'int32'`` ...).

    Arrays tagged with a ``hal_dtype`` attribute (16-bit storage carrying
    bf16, for example) report the tag.
    """
    if type(array_or_dtype) is np.ndarray:  # the hot path: no tag to look for, one dict lookup
        name = _NAMES.get(array_or_dtype.dtype)
        if name is not None:
            return name
    tag = getattr(array_or_dtype, "hal_dtype", None)
    if isinstance(tag, str):
        return tag
    dtype = getattr(array_or_dtype, "dtype", array_or_dtype)
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None  # the hot path: one dict lookup
    if name is not None:
        return name
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return str(dtype)
    return _NAMES.get(dtype) or str(dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a hal dtype name; ``'bf16'`` is ml_dtypes' bfloat16."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {sorted(_BY_NAME)}") from None


def dlpack_device(array: Any) -> tuple[int, int] | None:
    """``(DLPack device type code, device index)`` of ``array``, or None when it exports no DLPack device."""
    if type(array) is np.ndarray:
        return (DLPACK_CPU, 0)
    probe = getattr(array, "__dlpack_device__", None)
    if probe is None:
        return None
    code, index = probe()
    return int(code), int(index)


def device_of(array: Any) -> tuple[str, int]:
    """``(kind, index)`` of the memory holding ``array``: ``('cpu', 0)``, or DLPack's name, e.g. ``('kDLCUDA', 1)``."""
    if type(array) is np.ndarray:
        return ("cpu", 0)
    found = dlpack_device(array)
    if found is None:
        return ("cpu", 0) if isinstance(array, np.ndarray) else ("unknown", 0)
    code, index = found
    return (_DLPACK_KINDS.get(code, f"dlpack{code}"), index)


def is_c_contiguous(array: Any) -> bool:
    """Whether ``array`` is C-contiguous (row-major with no gaps)."""
    if type(array) is np.ndarray:
        return bool(array.flags.c_contiguous)
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

    A device array library without bfloat16 carries bf16 data as uint16
    storage tagged ``'bf16'``; kernels read the bits as bf16, nothing is converted.
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
