"""The launch plan of ``fused_moe``: its device buffers and its launches in order, as pure data.

Both the GPU op (:mod:`hal_cupy.ops._fused_moe`) and the host-compiled tests run exactly this plan: a
:class:`Step` names the compile unit (``'moe'``: ``fused_moe.cu``; ``'quant_x'`` / ``'quant_act'``:
``quant_util.cu`` at the hidden dtype / at float32), the launch, and each kernel parameter's value: a
buffer or input name (a ``str``: ``x``, ``logits``, ``w13``, ``w2``, ``out`` or a key of :func:`buffers`)
or a scalar. Every size comes from the arguments' shapes; nothing is read back from the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._specialization import Launch
from ._fused_moe_rules import (
    ACTIVATION_CODES,
    MOE_TILE,
    ROUTING_CODES,
    align_launch,
    combine_launch,
    gemm_kernels,
    gemm_launch,
    max_tiles,
    route_launch,
    scatter_launch,
)
from ._quantized_gemm_rules import quant_util_launch

__all__ = ["Buffer", "MoeShape", "Step", "buffers", "steps"]


@dataclass(frozen=True)
class MoeShape:
    """The sizes and settings of one call."""

    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    group_size: int
    bits: int
    routing: str = "softmax_topk"
    activation: str = "silu"
    int8_activations: bool = False  #: int4 experts as W4A8 (int8 experts are W8A8 whatever it says)

    @property
    def int8(self) -> bool:
        """Whether the GEMMs take int8 activations: each row quantised first (W8A8, W4A8)."""
        return self.bits == 8 or self.int8_activations

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def tiles(self) -> int:
        return max_tiles(self.num_tokens, self.top_k, self.num_experts)


@dataclass(frozen=True)
class Buffer:
    """A device buffer: shape, numpy dtype, and whether it must start zeroed (else every element is written)."""

    shape: tuple[int, ...]
    dtype: Any
    zeroed: bool = False


@dataclass(frozen=True)
class Step:
    """One launch: the compile unit, the launch, the kernel's arguments by parameter name."""

    unit: str
    launch: Launch
    args: Mapping[str, Any]


def buffers(s: MoeShape) -> dict[str, Buffer]:
    """The call's work buffers (about ``num_pairs * hidden + tiles * 8 * inter`` floats)."""
    rows = s.tiles * MOE_TILE
    found = {
        "counts": Buffer((s.num_experts,), np.int32, zeroed=True),
        "topk_ids": Buffer((s.num_pairs,), np.int32),
        "topk_weights": Buffer((s.num_pairs,), np.float32),
        "offsets": Buffer((s.num_experts + 1,), np.int32),
        "tile_expert": Buffer((s.tiles,), np.int32),
        "sorted_pairs": Buffer((rows,), np.int32),
        "cursor": Buffer((s.num_experts,), np.int32),
        "act": Buffer((rows, s.inter), np.float32),
        "y": Buffer((s.num_pairs, s.hidden), np.float32),
    }
    if s.int8:
        found.update({"xq": Buffer((s.num_tokens, s.hidden), np.int8), "sx": Buffer((s.num_tokens,), np.float32),
                      "aq": Buffer((rows, s.inter), np.int8), "sa": Buffer((rows,), np.float32)})
    return found


def steps(s: MoeShape, warp_size: int) -> list[Step]:
    """The launches of one call with at least one token, in stream order."""
    tiles = {"sorted_pairs": "sorted_pairs", "tile_expert": "tile_expert", "offsets": "offsets"}
    sizes = {"hidden": s.hidden, "inter": s.inter, "group_size": s.group_size, "num_experts": s.num_experts}
    gate_up, down = gemm_kernels(s.bits, s.int8_activations)
    plan = [
        Step("moe", route_launch(s.num_tokens),
             {"topk_ids": "topk_ids", "topk_weights": "topk_weights", "counts": "counts", "logits": "logits",
              "num_tokens": s.num_tokens, "num_experts": s.num_experts, "top_k": s.top_k,
              "routing": ROUTING_CODES[s.routing]}),
        Step("moe", align_launch(),
             {"offsets": "offsets", "tile_expert": "tile_expert", "sorted_pairs": "sorted_pairs", "cursor": "cursor",
              "counts": "counts", "num_experts": s.num_experts, "max_tiles": s.tiles}),
        Step("moe", scatter_launch(s.num_pairs),
             {"sorted_pairs": "sorted_pairs", "cursor": "cursor", "topk_ids": "topk_ids", "offsets": "offsets",
              "num_pairs": s.num_pairs}),
    ]
    if s.int8:
        plan.append(Step("quant_x", quant_util_launch("hal_w8a8_quantize_rows", s.num_tokens, 1),
                         {"xq": "xq", "sx": "sx", "x": "x", "K": s.hidden}))
        inputs: dict[str, Any] = {"xq": "xq", "sx": "sx"}
    else:
        inputs = {"x": "x"}
    plan.append(Step("moe", gemm_launch(gate_up, s.tiles, s.inter, warp_size),
                     {"act": "act", **inputs, **tiles, "w13": "w13", **sizes, "top_k": s.top_k,
                      "activation": ACTIVATION_CODES[s.activation]}))
    if s.int8:
        plan.append(Step("quant_act", quant_util_launch("hal_w8a8_quantize_rows", s.tiles * MOE_TILE, 1),
                         {"xq": "aq", "sx": "sa", "x": "act", "K": s.inter}))
        hidden_in: dict[str, Any] = {"aq": "aq", "sa": "sa"}
    else:
        hidden_in = {"act": "act"}
    plan.append(Step("moe", gemm_launch(down, s.tiles, s.hidden, warp_size),
                     {"y": "y", **hidden_in, **tiles, "w2": "w2", **sizes}))
    plan.append(Step("moe", combine_launch(s.num_tokens, s.hidden),
                     {"out": "out", "y": "y", "topk_weights": "topk_weights", "hidden": s.hidden, "top_k": s.top_k}))
    return plan
