"""The quantized layers a GPTQ checkpoint stores, whatever module holds them: :class:`ExportLayer`.

:func:`~hal_core.torch.save_quantized` writes one GPTQ layer per
:class:`QuantLinear`, and one per expert and projection of a
:class:`QuantMoE` (:mod:`._moe_layout`). Both become an :class:`ExportLayer`:
the sizes and settings the ``quantization_config`` is made from, and a way
to get the layer's hal weight on the host when its tensors are written (one
layer at a time: nothing is converted before its turn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..interop import host_view
from ..quant import QuantizedWeight
from ._modules import QuantLinear
from ._weights import _weight

__all__ = ["ExportLayer", "host_array", "linear_export"]


@dataclass(frozen=True)
class ExportLayer:
    """One quantized linear layer as GPTQ stores it.

    ``weight(codes)`` gives hal's weight over host arrays; with
    ``codes=False`` its ``qweight`` may be a meta tensor (the checks read only
    its shape, so no code is copied from a device for them).
    """

    bits: int
    group_size: int
    in_features: int
    out_features: int
    has_zeros: bool
    has_g_idx: bool
    weight: Callable[[bool], QuantizedWeight]
    bias: torch.Tensor | None = None


def host_array(tensor: torch.Tensor | None, name: str) -> Any:
    """A host numpy view of ``tensor`` (copied once from another device), or None."""
    return None if tensor is None else host_view(tensor.detach().cpu(), name)


def linear_export(layer: QuantLinear) -> ExportLayer:
    """The :class:`ExportLayer` of a :class:`QuantLinear` (its buffers read when the weight is asked for)."""
    def weight(codes: bool) -> QuantizedWeight:
        qweight = host_array(layer.qweight, "qweight") if codes else torch.empty_like(layer.qweight, device="meta")
        return _weight(qweight, host_array(layer.scales, "scales"), host_array(layer.zeros, "zeros"),
                       host_array(layer.g_idx, "g_idx"), layer.bits, layer.group_size)

    return ExportLayer(bits=layer.bits, group_size=layer.group_size, in_features=layer.in_features,
                       out_features=layer.out_features, has_zeros=layer.zeros is not None,
                       has_g_idx=layer.g_idx is not None, weight=weight, bias=layer.bias)
