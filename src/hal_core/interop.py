"""Bringing foreign arrays (DLPack, ``__cuda_array_interface__``, torch) into an op and back.

:func:`import_arrays` is called by the ops front door before validation.
It returns the arguments in the backend's own array type and a function
that turns results back into the caller's kind of array.

The rules (docs/engine-guide.md, "Interop"):

- Nothing is copied. A foreign array becomes a *view* of the same memory:
  ``numpy.from_dlpack`` for host memory, the backend's own
  :meth:`~hal_core.Backend.from_dlpack` for memory of a DLPack device type
  the backend lists in :attr:`~hal_core.Backend.dlpack_device_types`. On
  numpy >= 2.1 host imports ask the producer for ``copy=False``, so one
  that could only copy raises instead. Where both sides expose a data
  pointer (numpy, torch, anything with ``__array_interface__`` or a device
  array interface) the pointers are compared after the conversion, so a
  copy is refused; for a producer exposing no pointer the check cannot run,
  and hal relies on DLPack sharing memory.
- Strides are kept: a non-contiguous tensor stays non-contiguous, and the
  op's validation then names it, instead of a silent contiguous copy.
- Device memory handed to a host backend (or any memory the backend cannot
  address) is an :class:`~hal_core.ArgumentError` naming the argument.
  Which memory a backend addresses is decided by DLPack device type codes,
  never by the name of a vendor.
- bf16 has no DLPack route into numpy; it travels as 16-bit integer storage
  (a view) and is viewed back as ml_dtypes' bfloat16 on the host, or
  carried as a ``TaggedArray(uint16, 'bf16')`` on devices.
- A call given any torch tensor returns torch tensors (views of the
  result; ``out=`` returns the caller's own ``out`` tensor). Other inputs
  get the backend's native arrays back.
- ``torch`` is imported only when a torch tensor was passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import ArgumentError, ArgumentTypeError
from .arrays import BFLOAT16, DLPACK_HOST_TYPES, TaggedArray, device_of, dlpack_device
from .quant import QuantizedWeight

if TYPE_CHECKING:
    from ._backend import Backend
    from .ops import OpSpec

__all__ = ["host_view", "import_arrays", "is_torch_tensor", "to_native"]

#: numpy.from_dlpack takes ``copy=`` (and passes it to the producer) from numpy 2.1.
_DLPACK_COPY_KEYWORD = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


def _identity(value: Any) -> Any:
    return value


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, decided without importing torch."""
    kind = type(value)
    if kind in _TORCH_TYPES:
        return True
    module = kind.__module__
    found = (module == "torch" or module.startswith("torch.")) and hasattr(value, "data_ptr")
    if found:
        _TORCH_TYPES.add(kind)
    return found


#: Tensor types seen so far (``torch.Tensor``, ``Parameter``, ...): later checks are one set look-up.
_TORCH_TYPES: set[type] = set()


def import_arrays(spec: OpSpec, args: dict[str, Any], backend: Backend) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Arguments as native arrays (no copy), plus the converter for the result."""
    converted = args
    saw_torch = False
    for name in spec.weight_names:
        value = args.get(name)
        if not isinstance(value, QuantizedWeight):
            continue
        arrays = {}
        changed = False
        for field, array in value.arrays().items():
            if type(array) is np.ndarray:
                continue
            saw_torch |= is_torch_tensor(array)
            arrays[field] = native = to_native(array, backend, f"{name}.{field}")
            changed |= native is not array
        if changed:
            converted = converted if converted is not args else dict(args)
            converted[name] = replace(value, **arrays)
    for name in spec.array_names:
        value = args.get(name)
        if value is None or type(value) is np.ndarray:
            continue
        torch_tensor = is_torch_tensor(value)
        saw_torch |= torch_tensor
        native = _from_torch(value, backend, name) if torch_tensor else to_native(value, backend, name)
        if native is not value:
            converted = converted if converted is not args else dict(args)
            converted[name] = native
    if not saw_torch:
        return converted, _identity
    out_native, out_torch = converted.get("out"), args.get("out")

    def restore(result: Any) -> Any:
        if result is None:
            return None
        if out_native is not None and result is out_native and is_torch_tensor(out_torch):
            return out_torch
        return _to_torch(result)

    return converted, restore


def to_native(value: Any, backend: Backend, name: str = "array") -> Any:
    """``value`` as an array of ``backend``'s memory domain (or numpy), sharing its memory.

    Native arrays pass through. Raises :class:`~hal_core.ArgumentError`
    naming ``name`` when the memory is on a device ``backend`` cannot use,
    or when the conversion would copy.
    """
    if is_torch_tensor(value):
        return _from_torch(value, backend, name)
    if isinstance(value, (np.ndarray, TaggedArray)) or backend.owns(value):
        return value
    if hasattr(value, "__dlpack__"):
        found = dlpack_device(value)
        if found is not None:
            if found[0] in DLPACK_HOST_TYPES:
                try:
                    array = _host_from_dlpack(value)
                except (BufferError, TypeError, RuntimeError) as exc:
                    raise ArgumentTypeError(f"argument {name!r}: cannot view this {type(value).__name__} "
                                            f"through DLPack without a copy ({exc})") from exc
                return _checked(array, value, name)
            return _checked(_device_import(value, backend, name, found), value, name)
    return value  # not an array this module can import: the op's validation names it


def _host_from_dlpack(value: Any) -> np.ndarray:
    """A numpy view of a host DLPack producer, asking it not to copy where numpy can say so."""
    if _DLPACK_COPY_KEYWORD:
        try:
            return np.from_dlpack(value, copy=False)
        except TypeError:
            pass  # a producer older than DLPack 1.0 takes no copy keyword; its export is a view
    return np.from_dlpack(value)


# -- torch --------------------------------------------------------------------


def host_view(tensor: Any, name: str = "array") -> np.ndarray:
    """A numpy view of a CPU torch tensor (bf16 as ml_dtypes' bfloat16); ArgumentTypeError naming ``name``."""
    if tensor.requires_grad:
        tensor = tensor.detach()  # a view: autograd is not hal's business
    bf16, int16 = _TORCH_DTYPES or _torch_dtypes()
    is_bf16 = tensor.dtype is bf16
    try:  # Tensor.numpy() is always a view of the tensor's memory (torch refuses where it cannot be one)
        array = (tensor.view(int16) if is_bf16 else tensor).numpy()
    except (TypeError, RuntimeError) as exc:
        raise ArgumentTypeError(f"argument {name!r}: torch dtype {tensor.dtype} has no numpy view ({exc})") from exc
    return array.view(BFLOAT16) if is_bf16 else array


#: ``(torch.bfloat16, torch.int16)`` once a caller has handed hal a tensor (hal never imports torch itself).
_TORCH_DTYPES: tuple[Any, Any] | None = None


def _torch_dtypes() -> tuple[Any, Any]:
    """``(torch.bfloat16, torch.int16)``, looked up once: :func:`host_view` compares a dtype on every call."""
    global _TORCH_DTYPES
    import torch

    _TORCH_DTYPES = (torch.bfloat16, torch.int16)
    return _TORCH_DTYPES


def _from_torch(tensor: Any, backend: Backend, name: str) -> Any:
    import torch

    if tensor.device.type == "cpu":
        return host_view(tensor, name)
    if tensor.requires_grad:
        tensor = tensor.detach()  # a view: autograd is not hal's business
    bf16 = tensor.dtype == torch.bfloat16
    storage = tensor.view(torch.int16) if bf16 else tensor  # same bits, same strides
    problem = "no __dlpack_device__"
    try:
        found = dlpack_device(storage)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        found, problem = None, str(exc)
    if found is None:
        raise ArgumentError(
            f"argument {name!r} is a torch tensor on {tensor.device}, which exports no DLPack device "
            f"({problem}); move it with tensor.cpu()"
        )
    array = _device_import(storage, backend, name, found)
    if bf16:
        return _checked(TaggedArray(array.view("uint16"), "bf16"), tensor, name)
    return _checked(array, tensor, name)


def _to_torch(result: Any) -> Any:
    import torch

    if isinstance(result, TaggedArray):
        if result.hal_dtype != "bf16":
            raise ArgumentTypeError(f"cannot return a {result.hal_dtype} result as a torch tensor")
        return torch.from_dlpack(result.storage.view("int16")).view(torch.bfloat16)
    if isinstance(result, np.ndarray):
        if result.dtype == BFLOAT16:
            return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(result)
    return torch.from_dlpack(result)


# -- device memory ------------------------------------------------------------


def _device_import(value: Any, backend: Backend, name: str, device: tuple[int, int]) -> Any:
    """A zero-copy array of ``backend`` over ``value``, or an ArgumentError if it cannot address it."""
    code, index = device
    kind = device_of(value)[0] if hasattr(value, "__dlpack_device__") else f"dlpack{code}"
    where = f"{kind}:{index}"
    if code not in backend.dlpack_device_types:
        if backend.is_host:
            raise ArgumentError(
                f"argument {name!r} lives on {where}, but backend {backend.name!r} works on host memory; "
                f"copy it to the host first (e.g. tensor.cpu()) or use the backend of that device"
            )
        raise ArgumentError(
            f"argument {name!r} lives on {where}, which backend {backend.name!r} does not address "
            f"(it addresses DLPack device types {sorted(backend.dlpack_device_types)}); "
            f"use the backend of that device"
        )
    return backend.from_dlpack(value)


def _pointer(array: Any) -> int | None:
    """The address of an array's first element, where the library tells it."""
    if isinstance(array, TaggedArray):
        array = array.storage
    if is_torch_tensor(array):
        return int(array.data_ptr())
    interface = getattr(array, "__array_interface__", None)
    if isinstance(interface, dict):
        return int(interface["data"][0])
    data = getattr(array, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if isinstance(ptr, int) else None


def _checked(native: Any, original: Any, name: str) -> Any:
    """``native`` after making sure it shares ``original``'s memory.

    The check needs both data pointers; where ``original`` (or a backend's
    own import) exposes none, it cannot run and ``native`` is returned as is.
    """
    size = getattr(native, "size", 1)
    a, b = _pointer(native), _pointer(original)
    if size and a is not None and b is not None and a != b:
        raise ArgumentError(
            f"argument {name!r}: bringing this {type(original).__name__} in would copy it; "
            f"pass an array of the backend's memory domain or one that exports DLPack without a copy"
        )
    return native
