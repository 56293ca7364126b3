"""Which hal backend runs a torch op, and on which stream.

The backend is chosen by the device of the op's first tensor: the selected
backend (``hal_core.get_backend()``) when it addresses that memory, else the
highest-priority available backend that does. Host tensors go to a host
backend (:attr:`~hal_core.Backend.is_host`); device tensors to a backend whose
:attr:`~hal_core.Backend.dlpack_device_types` lists their DLPack device type.
The choice is made once per device and kept until :func:`hal_core.reset`
(or a change of ``HAL_BACKEND``), so an op call costs a dictionary look-up.

A device backend enqueues on its *current* stream, so device work runs inside
:func:`on_torch_stream`, which makes torch's current stream the backend's
current one (:meth:`~hal_core.DeviceHandle.wrap_stream`: no new stream, no sync).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .. import _env, get_backend, list_backends
from .._backend import Backend
from .._errors import ArgumentError
from .._runtime import current
from ..arrays import dlpack_device

__all__ = ["backend_for", "on_torch_stream"]

#: (id(runtime), HAL_BACKEND, device type, index) -> (weak reference to the runtime, backend). The reference
#: is checked on every look-up: ids are reused once an object is freed, and a reset's new runtime must never
#: take a stale entry (whose backend would count its calls in a runtime nobody reads).
_chosen: dict[tuple[int, str | None, str, int], tuple[weakref.ref[Any], Backend]] = {}
_lock = threading.Lock()


def backend_for(tensor: torch.Tensor) -> Backend:
    """The hal backend that addresses ``tensor``'s memory; ArgumentError when none does."""
    runtime = current()
    if tensor.is_cpu:  # no torch.device object made: the common case
        key = (id(runtime), _env.backend_override(), "cpu", 0)
    else:
        device = tensor.device
        key = (id(runtime), _env.backend_override(), device.type, device.index or 0)
    found = _chosen.get(key)
    if found is not None and found[0]() is runtime:
        return found[1]
    backend = _choose(tensor)
    with _lock:
        if len(_chosen) > 64:  # stale runtimes' entries: never consulted again
            _chosen.clear()
        _chosen[key] = (weakref.ref(runtime), backend)
    return backend


def _addresses(backend: Backend, tensor: torch.Tensor) -> bool:
    if tensor.is_cpu:
        return backend.is_host
    try:
        found = dlpack_device(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError):
        return False
    return found is not None and found[0] in backend.dlpack_device_types


def _choose(tensor: torch.Tensor) -> Backend:
    selected = get_backend()
    if _addresses(selected, tensor):
        return selected
    for info in list_backends():
        if info.available and info.name != selected.name:
            backend = get_backend(info.name)
            if _addresses(backend, tensor):
                return backend
    raise ArgumentError(
        f"no available hal backend addresses memory on torch device {tensor.device}; "
        f"`hal info` lists the installed backends and why each is unavailable"
    )


@contextlib.contextmanager
def on_torch_stream(backend: Backend, tensor: torch.Tensor) -> Iterator[None]:
    """Run the block with torch's current stream of ``tensor``'s device as the backend's current stream.

    hal's ops on device tensors neither read device memory back nor
    synchronise (their index checks run in the kernels), so a call inside a
    CUDA graph capture is captured like any other launch.
    """
    if tensor.is_cpu:
        yield
        return
    module = torch.get_device_module(tensor.device)  # torch's per-device-type module, named by the tensor
    index = tensor.device.index if tensor.device.index is not None else module.current_device()
    try:
        wrapped = backend.device(index).wrap_stream(module.current_stream(index))
    except NotImplementedError as exc:
        raise ArgumentError(f"backend {backend.name!r} cannot follow torch's current stream: {exc}") from exc
    with wrapped:
        yield
