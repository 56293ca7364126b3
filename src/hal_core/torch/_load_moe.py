"""Loading a checkpoint's quantized experts into :class:`QuantMoE` blocks (the stored layout: :mod:`._moe_layout`).

:func:`plan_moe` finds the model's sparse MoE blocks whose experts the
checkpoint stores quantized (an expert 0 gate projection with a
``.qweight``) and checks every expert's stored tensors from their headers;
:func:`load_moe` then reads one block's experts, one expert at a time,
joins each expert's gate and up projections into hal's ``w13`` (the gate's
columns first, as :class:`QuantMoE` holds them) and builds the module
around the block's router. Blocks stored in float are left to the model's
own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError, ConfigurationError
from ..quant import ExpertWeights, QuantizedWeight
from ..quant._checkpoint_format import CheckpointFormat
from ._checkpoint_files import Tensors
from ._moe import QuantMoE
from ._moe_block import MoeSettings, moe_blocks, moe_settings
from ._moe_layout import MOE_LAYOUTS, MoeLayout
from ._stored_layers import check_stored_layer, read_stored_layer

__all__ = ["MoeLoad", "load_moe", "plan_moe"]


@dataclass(frozen=True)
class MoeLoad:
    """One model MoE block whose experts the checkpoint stores quantized, checked and ready to load."""

    name: str               #: the block's name in the model
    block: torch.nn.Module  #: the model's (meta) block: its router is kept, its experts replaced
    prefix: str             #: the block's stored name
    layout: MoeLayout
    settings: MoeSettings
    num_experts: int
    hidden: int
    intermediate: int

    def replace(self, model: torch.nn.Module, module: QuantMoE) -> None:
        """Put ``module`` where the block sits in ``model``."""
        parent, _, attr = self.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)


def _sizes(block: torch.nn.Module, name: str) -> tuple[int, int, int]:
    experts: Any = getattr(block, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
        raise CheckpointError(f"MoE block {name!r}: the model's experts hold no gate_up_proj / down_proj; hal "
                              f"loads quantized experts into Qwen3-MoE and Mixtral blocks")
    num_experts, joined, hidden = gate_up.shape
    return int(num_experts), int(hidden), int(joined) // 2


def plan_moe(model: torch.nn.Module, tensors: Tensors, fmt: CheckpointFormat, config: Any) -> list[MoeLoad]:
    """The blocks to load as :class:`QuantMoE`, every stored expert tensor checked from its header.

    CheckpointError, naming the block or the layer and tensor, for a
    missing expert, a tensor of the wrong shape or dtype, experts of
    different bits or group sizes, or a config the block's routing cannot
    be read from.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layout = MOE_LAYOUTS.get(str(getattr(text, "model_type", "")))
    if layout is None:
        return []
    loads = []
    for name, block in moe_blocks(model):
        prefix = layout.stored_prefix(name)
        if f"{layout.expert_layer(prefix, 0, 0)}.qweight" not in tensors:
            continue  # stored in float: the model's own tensors
        try:
            settings = moe_settings(block, config, name)
        except (ConfigurationError, TypeError) as exc:
            raise CheckpointError(f"config.json: {exc}") from None
        num_experts, hidden, inter = _sizes(block, name)
        first = fmt.for_layer(layout.expert_layer(prefix, 0, 0))
        for e in range(num_experts):
            for projection, (k, n) in enumerate(((hidden, inter), (hidden, inter), (inter, hidden))):
                layer = layout.expert_layer(prefix, e, projection)
                found = fmt.for_layer(layer)
                if (found.bits, found.group_size) != (first.bits, first.group_size):
                    raise CheckpointError(f"MoE block {name!r}: layer {layer!r} has bits={found.bits}, group_size="
                                          f"{found.group_size}, expert 0's gate bits={first.bits}, group_size="
                                          f"{first.group_size}; hal runs a block's experts in one format")
                check_stored_layer(fmt, layer, k, n, tensors)
        loads.append(MoeLoad(name, block, prefix, layout, settings, num_experts, hidden, inter))
    return loads


def _join(gate: QuantizedWeight, up: QuantizedWeight, where: str) -> QuantizedWeight:
    """``gate`` and ``up`` as one weight, the gate's columns first (one copy of the two)."""
    if (gate.g_idx is None) != (up.g_idx is None) or (
            gate.g_idx is not None and not np.array_equal(np.asarray(gate.g_idx), np.asarray(up.g_idx))):
        raise CheckpointError(f"{where}: the gate and up projections order their rows differently (g_idx, "
                              f"act-order); hal runs them as one projection with one row order")
    if (gate.zeros is None) != (up.zeros is None):
        raise CheckpointError(f"{where}: one of the gate and up projections has zero points and the other not")

    def both(a: Any, b: Any) -> Any:
        return None if a is None else np.concatenate([np.asarray(a), np.asarray(b)], axis=1)

    return QuantizedWeight(qweight=both(gate.qweight, up.qweight), scales=both(gate.scales, up.scales),
                           zeros=both(gate.zeros, up.zeros), bits=gate.bits, group_size=gate.group_size,
                           shape=(gate.shape[0], gate.shape[1] + up.shape[1]), g_idx=gate.g_idx)


def load_moe(load: MoeLoad, fmt: CheckpointFormat, tensors: Tensors, device: torch.device,
             activations: str | None = None) -> QuantMoE:
    """The block's experts read and converted (one expert at a time), as a :class:`QuantMoE` on ``device``
    holding the block's router, running with ``activations`` (:class:`QuantMoE`'s)."""
    w13, w2 = [], []
    for e in range(load.num_experts):
        gate, up, down = (read_stored_layer(fmt, load.layout.expert_layer(load.prefix, e, p), tensors)
                          for p in range(3))
        w13.append(_join(gate, up, f"MoE block {load.name!r}, expert {e}"))
        w2.append(down)
    try:
        experts = ExpertWeights(tuple(w13), tuple(w2))
    except ValueError as exc:
        raise CheckpointError(f"MoE block {load.name!r}: {exc}") from None
    del w13, w2
    router: Any = load.block.gate
    module = QuantMoE(router, experts, top_k=load.settings.top_k, routing=load.settings.routing,
                      activation=load.settings.activation, name=load.name,
                      jitter_noise=float(getattr(load.block, "jitter_noise", 0.0)), activations=activations)
    if device.type != "cpu":
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return module
