"""Which hal backend runs a torch op, and on which stream.

The backend is chosen by the device of the op's first tensor: the selected
backend (``hal_core.get_backend()``) when it owns that memory, else the
highest-priority available backend that does. Host tensors are owned by the
host backend (the one that owns numpy arrays); CUDA tensors by a GPU
backend. A device backend enqueues on its *current* stream, so device work
runs inside :func:`torch_stream`, which makes torch's current stream the
backend's current one (a wrapped foreign stream: no new stream, no sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import get_backend, list_backends
from .._backend import Backend
from .._errors import ArgumentError

__all__ = ["backend_for", "on_torch_stream"]


def backend_for(tensor: torch.Tensor) -> Backend:
    """The hal backend that owns ``tensor``'s memory; ArgumentError when none does."""
    probe: Any = np.empty(0) if tensor.device.type == "cpu" else tensor
    selected = get_backend()
    if selected.owns(probe):
        return selected
    for info in list_backends():
        if info.available and info.name != selected.name:
            backend = get_backend(info.name)
            if backend.owns(probe):
                return backend
    raise ArgumentError(
        f"no available hal backend owns memory on torch device {tensor.device}; "
        f"`hal info` lists the installed backends and why each is unavailable"
    )


@contextlib.contextmanager
def on_torch_stream(backend: Backend, tensor: torch.Tensor) -> Iterator[None]:
    """Run the block with torch's current stream of ``tensor``'s device as the backend's current stream.

    hal's ops on device tensors neither read device memory back nor
    synchronise (their index checks run in the kernels), so a call inside a
    CUDA graph capture is captured like any other launch.
    """
    if tensor.device.type == "cpu":
        yield
        return
    module = torch.get_device_module(tensor.device)  # torch's per-device-type module, named by the tensor
    index = tensor.device.index if tensor.device.index is not None else module.current_device()
    device = backend.device(index)
    wrap = getattr(device, "wrap_stream", None)
    if wrap is None:
        raise ArgumentError(
            f"backend {backend.name!r} cannot run on a foreign stream (its devices have no wrap_stream), "
            f"so it cannot follow torch's current stream"
        )
    with wrap(module.current_stream(index)):
        yield
