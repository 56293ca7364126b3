"""A :class:`~hal_core.quant.QuantizedWeight` as plain torch tensors (and back).

A model keeps its quantized projections as buffers: convert each weight
once with :func:`weight_to_tensors`, register the tensors
(``module.register_buffer(...)``), and call ``torch.ops.hal.quantized_gemm``
with them. The tensors are hal's format unchanged, with one change of
*type*, not of bits: the packed int4 ``qweight`` (uint32 in hal) is held as
an int32 view, because torch's uint32 is a storage-only dtype that most
torch operators (and ``torch.library.opcheck``) cannot handle.

==========  ====================================  ==============================
name        int4 (``bits=4``)                      int8 (``bits=8``)
==========  ====================================  ==============================
qweight     int32 ``[K/8, N]`` (hal's uint32 bits)  uint8 ``[K, N]``
scales      fp16/bf16/fp32 ``[K/G, N]``           same
zeros       uint8 ``[K/G, N]``, absent if symmetric  same
g_idx       int32 ``[K]``, absent unless act-order  same
==========  ====================================  ==============================
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..quant import QuantizedWeight
from ._convert import to_tensor

__all__ = ["weight_from_tensors", "weight_to_tensors"]

_FIELDS = ("qweight", "scales", "zeros", "g_idx")


def weight_to_tensors(weight: QuantizedWeight, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The arrays of ``weight`` as torch tensors on ``device`` (default: where they are).

    Host arrays become views (no copy) when ``device`` is the CPU or None;
    moving to another device copies once. None fields (``zeros`` of a
    symmetric weight, ``g_idx`` without act-order) are left out.
    """
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight_to_tensors: expected a hal_core.quant.QuantizedWeight, got {type(weight).__name__}")
    tensors = {}
    for name, array in weight.arrays().items():
        if isinstance(array, np.ndarray) and not array.flags["C_CONTIGUOUS"]:
            array = np.ascontiguousarray(array)
        tensor = to_tensor(array)
        if name == "qweight" and tensor.dtype == torch.uint32:
            tensor = tensor.view(torch.int32)
        tensors[name] = tensor if device is None else tensor.to(device)
    return tensors


def weight_from_tensors(tensors: Mapping[str, torch.Tensor], bits: int) -> QuantizedWeight:
    """The :class:`QuantizedWeight` over ``tensors`` (views, no copy); inverse of :func:`weight_to_tensors`.

    ``K`` comes from ``qweight`` (``8 * rows`` for int4), ``N`` from its
    columns and the group size from ``K // scales.shape[0]``; the weight's
    own checks then reject inconsistent shapes.
    """
    unknown = set(tensors) - set(_FIELDS)
    if unknown:
        raise ValueError(f"weight_from_tensors: unknown tensors {sorted(unknown)}; expected some of {_FIELDS}")
    for required in ("qweight", "scales"):
        if tensors.get(required) is None:
            raise ValueError(f"weight_from_tensors: the {required!r} tensor is missing")
    if bits not in (4, 8):
        raise ValueError(f"weight_from_tensors: bits must be 4 or 8, got {bits}")
    return _weight(tensors["qweight"], tensors["scales"], tensors.get("zeros"), tensors.get("g_idx"), bits)


def _weight(qweight: Any, scales: Any, zeros: Any | None, g_idx: Any | None, bits: int,
            group_size: int | None = None) -> QuantizedWeight:
    """Build the weight (torch tensors, or their numpy views), viewing an int32 int4 ``qweight`` as hal's uint32."""
    if qweight.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"quantized weight: qweight and scales must be 2-D, got shapes "
                         f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
    rows, n = qweight.shape
    k = 8 * rows if bits == 4 else rows
    if group_size is None:
        group_size = k // scales.shape[0] if scales.shape[0] else 0
    packed: Any = qweight
    if bits == 4 and qweight.dtype in (torch.int32, np.int32):
        packed = qweight.view(torch.uint32 if isinstance(qweight, torch.Tensor) else np.uint32)
    return QuantizedWeight(qweight=packed, scales=scales, zeros=zeros, bits=bits, group_size=group_size,
                           shape=(k, n), g_idx=g_idx)


# -- host weights for torch.ops.hal, built once per set of tensors -------------------------------

#: id(qweight tensor) -> (weak reference to it, the tensors' signature, the weight over raw views).
_HOST_WEIGHTS: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], QuantizedWeight]] = {}
#: More entries than any model has quantized layers; beyond it the cache starts over.
_HOST_WEIGHTS_MAX = 4096


class _Raw:
    """An ``__array_interface__`` over a tensor's memory that holds no reference to the tensor."""

    def __init__(self, array: np.ndarray) -> None:
        self.__array_interface__ = array.__array_interface__


def _signature(tensors: tuple[torch.Tensor | None, ...], bits: int, group_size: int) -> tuple[Any, ...]:
    described = (None if t is None else (id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
    return (bits, group_size, *described)


def _forget(key: int) -> Any:
    return lambda _: _HOST_WEIGHTS.pop(key, None)


def host_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                g_idx: torch.Tensor | None, bits: int, group_size: int) -> QuantizedWeight:
    """The weight over CPU tensors as numpy views, built and checked once per set of tensors.

    A ``torch.ops.hal`` call on host tensors would otherwise take four numpy views and re-check the
    weight's shapes on every call. The entry is found again only while ``qweight`` is alive and every
    tensor has the same identity, address, shape, strides and dtype (so the views still describe the
    memory the caller passes); it is dropped when ``qweight`` is freed, and the views hold no reference
    that would keep a freed model's weights alive.
    """
    tensors = (qweight, scales, zeros, g_idx)
    signature = _signature(tensors, bits, group_size)
    key = id(qweight)
    found = _HOST_WEIGHTS.get(key)
    if found is not None and found[0]() is qweight and found[1] == signature:
        return found[2]
    from ..interop import host_view

    views = []
    for tensor, name in zip(tensors, _FIELDS, strict=True):
        view = None if tensor is None else host_view(tensor, name)
        views.append(None if view is None else np.asarray(_Raw(view)).view(view.dtype))
    weight = _weight(views[0], views[1], views[2], views[3], bits, group_size)
    if len(_HOST_WEIGHTS) >= _HOST_WEIGHTS_MAX:
        _HOST_WEIGHTS.clear()
    _HOST_WEIGHTS[key] = (weakref.ref(qweight, _forget(key)), signature, weight)
    return weight
