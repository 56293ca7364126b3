"""Device arrays in and out: CuPy arrays, TaggedArray (bf16 as uint16 storage), and foreign arrays.

Foreign device arrays come in without a copy: ``cupy.asarray`` on an object
with ``__cuda_array_interface__`` shares its memory, and so does
``cupy.from_dlpack``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hal_core.arrays import BFLOAT16, TaggedArray, dtype_name, untag

from ._cupy import cupy

__all__ = ["KERNEL_DTYPES", "aligned", "as_storage", "empty_like_dtype", "kernel_dtype", "to_device", "to_host",
           "zeros_like_dtype"]

#: hal dtype names to the catalogue's names (``_specialization.DTYPE_CODES``).
KERNEL_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def kernel_dtype(array: Any) -> str:
    """The catalogue's dtype name of ``array`` (``'float16'``, ``'bfloat16'``, ``'float32'``)."""
    name = dtype_name(array)
    try:
        return KERNEL_DTYPES[name]
    except KeyError:
        raise TypeError(f"no kernel dtype for {name}") from None


def as_storage(array: Any) -> Any:
    """The CuPy array holding ``array``'s bits, without a copy (TaggedArray: its storage)."""
    value = untag(array)
    cp = cupy()
    if isinstance(value, cp.ndarray):
        return value
    if hasattr(value, "__cuda_array_interface__"):
        return cp.asarray(value)
    if hasattr(value, "__dlpack__"):
        return cp.from_dlpack(value)
    raise TypeError(f"{type(value).__name__} is not a CUDA device array")


def aligned(array: Any, alignment: int = 16) -> bool:
    """Whether the first byte of a device array lies on an ``alignment``-byte boundary."""
    return as_storage(array).data.ptr % alignment == 0


def empty_like_dtype(shape: tuple[int, ...], hal_dtype: str) -> Any:
    """A new device array of ``shape`` holding ``hal_dtype`` (bf16 as a tagged uint16 array)."""
    cp = cupy()
    if hal_dtype == "bf16":
        return TaggedArray(cp.empty(shape, dtype=np.uint16), "bf16")
    return cp.empty(shape, dtype={"fp32": np.float32, "fp16": np.float16}.get(hal_dtype, hal_dtype))


def zeros_like_dtype(shape: tuple[int, ...], hal_dtype: str) -> Any:
    """A new zero-filled device array of ``shape`` holding ``hal_dtype`` (bf16 as a tagged uint16 array)."""
    cp = cupy()
    if hal_dtype == "bf16":
        return TaggedArray(cp.zeros(shape, dtype=np.uint16), "bf16")
    return cp.zeros(shape, dtype={"fp32": np.float32, "fp16": np.float16}.get(hal_dtype, hal_dtype))


def to_device(array: Any, device_index: int) -> Any:
    """``array`` on device ``device_index``: host arrays copied in, device arrays moved if elsewhere."""
    cp = cupy()
    if isinstance(array, TaggedArray):
        return TaggedArray(to_device(array.storage, device_index), array.hal_dtype)
    with cp.cuda.Device(device_index):
        if isinstance(array, np.ndarray):
            if array.dtype == BFLOAT16:
                return TaggedArray(cp.asarray(array.view(np.uint16)), "bf16")
            return cp.asarray(array)
        if isinstance(array, cp.ndarray):
            return array if array.device.id == device_index else cp.array(array, copy=True)
        if hasattr(array, "__cuda_array_interface__") or hasattr(array, "__dlpack__"):
            storage = as_storage(array)
            return storage if storage.device.id == device_index else cp.array(storage, copy=True)
        return cp.asarray(np.asarray(array))


def to_host(array: Any) -> np.ndarray:
    """A numpy copy of a device array (bf16 comes back as ml_dtypes' bfloat16)."""
    if type(array) is np.ndarray:
        return array
    if isinstance(array, TaggedArray):
        host = to_host(array.storage)
        return host.view(BFLOAT16) if array.hal_dtype == "bf16" else host
    return as_storage(array).get()
