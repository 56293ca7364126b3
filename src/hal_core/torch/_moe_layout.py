"""How a :class:`QuantMoE` block is saved: one GPTQ linear layer per expert and projection.

The stored names follow the MoE checkpoint layouts of
:mod:`hal_core.quant._moe_layout` (Qwen3-MoE ``<layer>.mlp.experts.<e>.gate_proj``,
Mixtral ``<layer>.block_sparse_moe.experts.<e>.w1``, ...). transformers 5 holds
both blocks at ``<layer>.mlp``; everything under a Mixtral block is stored under
``<layer>.block_sparse_moe`` (what :func:`stored_name` maps).
:class:`QuantMoE`'s ``w13[e]`` is the gate's columns then the up
projection's (``[hidden, 2 * intermediate]``), ``w2[e]`` the down
projection: the stored layers are its column slices, with the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError
from ..quant import QuantizedWeight
from ..quant._moe_layout import MOE_LAYOUTS, MoeLayout
from ._moe import QuantMoE
from ._save_layers import ExportLayer, host_array
from ._weights import _weight

__all__ = ["MOE_LAYOUTS", "MoeLayout", "moe_export_layers", "moe_layout", "stored_name"]


def moe_layout(config: Any, block: str) -> MoeLayout:
    """The layout of ``config``'s model type; CheckpointError naming the MoE block ``block`` for any other."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in MOE_LAYOUTS:
        raise CheckpointError(f"MoE block {block!r}: hal knows how {', '.join(MOE_LAYOUTS)} checkpoints store their "
                              f"experts, not {kind!r} ones")
    return MOE_LAYOUTS[kind]


def stored_name(name: str, renames: dict[str, str]) -> str:
    """``name`` (a model tensor's) as stored: under the stored prefix of the block it belongs to, if renamed."""
    for model_prefix, stored in renames.items():
        if name.startswith(model_prefix + "."):
            return stored + name[len(model_prefix):]
    return name


def _columns(tensor: torch.Tensor | None, expert: int, lo: int, hi: int, name: str) -> Any:
    if tensor is None:
        return None
    return np.ascontiguousarray(host_array(tensor[expert, :, lo:hi], name))


def _projection(module: QuantMoE, expert: int, projection: int) -> ExportLayer:
    prefix = "w2" if projection == 2 else "w13"
    inter = module.intermediate_size
    lo, hi = (0, module.hidden_size) if projection == 2 else (projection * inter, (projection + 1) * inter)
    k = inter if projection == 2 else module.hidden_size
    buffers = {field: getattr(module, f"{prefix}_{field}", None) for field in ("qweight", "scales", "zeros", "g_idx")}

    def weight(codes: bool) -> QuantizedWeight:
        qweight = buffers["qweight"]
        assert qweight is not None
        packed = (_columns(qweight, expert, lo, hi, "qweight") if codes
                  else torch.empty((qweight.shape[1], hi - lo), dtype=qweight.dtype, device="meta"))
        g_idx = buffers["g_idx"]
        return _weight(packed, _columns(buffers["scales"], expert, lo, hi, "scales"),
                       _columns(buffers["zeros"], expert, lo, hi, "zeros"),
                       None if g_idx is None else np.ascontiguousarray(host_array(g_idx[expert], "g_idx")),
                       module.bits, module.group_size)

    return ExportLayer(bits=module.bits, group_size=module.group_size, in_features=k, out_features=hi - lo,
                       has_zeros=buffers["zeros"] is not None, has_g_idx=buffers["g_idx"] is not None, weight=weight)


def moe_export_layers(name: str, module: QuantMoE, layout: MoeLayout) -> Iterator[tuple[str, ExportLayer]]:
    """Each expert's gate, up and down projections of the block at ``name``, under their stored names."""
    prefix = layout.stored_prefix(name)
    for expert in range(module.num_experts):
        for projection in range(3):
            yield layout.expert_layer(prefix, expert, projection), _projection(module, expert, projection)
