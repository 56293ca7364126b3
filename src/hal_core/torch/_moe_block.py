"""transformers' sparse MoE blocks that :class:`QuantMoE` replaces: which ones, their settings, their checks.

A block hal runs is one of :data:`BLOCKS` (matched by class name) with a
router ``gate`` (``weight [num_experts, hidden]``) and ``experts`` holding
3-D ``gate_up_proj [num_experts, 2 * intermediate, hidden]`` (the gate's
rows first: transformers splits the projection with ``chunk(2)`` into gate,
then up) and ``down_proj [num_experts, hidden, intermediate]``. hal's layout
is their transpose per expert: ``w13[e] = gate_up_proj[e].T`` ``[hidden,
2 * intermediate]`` (gate columns, then up) and ``w2[e] = down_proj[e].T``.

The settings come from the model's config (:func:`moe_settings`):
``num_experts_per_tok`` -> ``top_k``, ``hidden_act`` -> ``activation``,
and the routing per architecture: Qwen3-MoE ``norm_topk_prob`` True ->
``'softmax_topk_renorm'``, False -> ``'softmax_topk'``; Mixtral ->
``'softmax_topk_renorm'``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ArgumentTypeError, ConfigurationError
from ..engine._config import ACTIVATIONS
from ._modules import resolve_group_size
from ._quantize_checks import _WEIGHT_DTYPES, _value_problem

__all__ = ["BLOCKS", "MoeSettings", "block_problem", "expert_tensors", "is_moe_like", "moe_blocks", "moe_settings"]


def _qwen3_routing(config: Any) -> str:
    return "softmax_topk_renorm" if bool(_field(config, "norm_topk_prob")) else "softmax_topk"


#: Sparse MoE block classes hal runs -> the routing their config asks for.
BLOCKS: dict[str, Callable[[Any], str]] = {
    "Qwen3MoeSparseMoeBlock": _qwen3_routing,
    "MixtralSparseMoeBlock": lambda config: "softmax_topk_renorm",
}


@dataclass(frozen=True)
class MoeSettings:
    """How a block routes and activates: ``fused_moe``'s ``top_k``, ``routing`` and ``activation``."""

    top_k: int
    routing: str
    activation: str


_MISSING = object()


def _field(config: Any, key: str) -> Any:
    value = getattr(config, key, _MISSING)
    if value is _MISSING:
        raise ConfigurationError(f"config field {key!r} is missing ({type(config).__name__}); the MoE block's "
                                 f"routing needs it")
    return value


def _block_type(block: torch.nn.Module, name: str | None) -> str:
    cls = type(block).__name__
    if cls not in BLOCKS:
        where = f" ({name!r})" if name else ""
        raise ArgumentTypeError(f"argument 'block'{where}: {cls} is not a sparse MoE block hal runs (it runs "
                                f"{', '.join(BLOCKS)})")
    return cls


def moe_settings(block: torch.nn.Module, config: Any, name: str | None = None) -> MoeSettings:
    """``block``'s settings from ``config`` (a transformers config; its text config when it has one).

    ArgumentTypeError for a block type hal does not run, ConfigurationError naming a config field that is
    missing or holds a value hal cannot run, or that disagrees with the block's router.
    """
    cls = _block_type(block, name)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    where = f"MoE block {name!r}" if name else cls
    try:
        top_k = _field(config, "num_experts_per_tok")
        act = _field(config, "hidden_act")
        routing = BLOCKS[cls](config)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    experts = _num_experts(block)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigurationError(f"{where}: config field 'num_experts_per_tok': expected an int in [1, {experts}] "
                                 f"(the block's experts), got {top_k!r}")
    router = getattr(block, "gate", None)
    router_k = getattr(router, "top_k", top_k)
    if router_k != top_k:
        raise ConfigurationError(f"{where}: config field 'num_experts_per_tok' is {top_k}, but the block's router "
                                 f"takes top_k={router_k}; pass the config the model was built with")
    router_norm = getattr(router, "norm_topk_prob", None)
    if router_norm is not None and bool(router_norm) != (routing == "softmax_topk_renorm"):
        raise ConfigurationError(f"{where}: config field 'norm_topk_prob' is {not router_norm}, but the block's "
                                 f"router has norm_topk_prob={router_norm}; pass the config the model was built with")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ConfigurationError(f"{where}: config field 'hidden_act': {act!r} is not one of {', '.join(ACTIVATIONS)}")
    return MoeSettings(top_k=top_k, routing=routing, activation=ACTIVATIONS[act])


def _num_experts(block: torch.nn.Module) -> int:
    weight = getattr(getattr(block, "gate", None), "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0


def expert_tensors(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj [E, 2I, H], down_proj [E, H, I])`` of a block (detached, no copy)."""
    experts: Any = block.experts
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


def _shape_problem(block: torch.nn.Module) -> str | None:
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    router = getattr(gate, "weight", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(t, torch.Tensor) for t in (router, gate_up, down)):
        return "expected gate.weight, experts.gate_up_proj and experts.down_proj tensors"
    assert isinstance(router, torch.Tensor) and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if router.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return (f"expected gate.weight [E, H], experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]; got "
                f"{tuple(router.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    e, hidden = router.shape
    inter = gate_up.shape[1] // 2
    if tuple(gate_up.shape) != (e, 2 * inter, hidden) or tuple(down.shape) != (e, hidden, inter):
        return (f"experts.gate_up_proj {tuple(gate_up.shape)} and experts.down_proj {tuple(down.shape)} do not "
                f"fit [{e}, 2 * intermediate, {hidden}] and [{e}, {hidden}, intermediate] (gate.weight "
                f"{tuple(router.shape)})")
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, bias, None) is not None:
            return f"experts.{bias} is set; hal's experts have no biases"
    for what, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
        if tensor.dtype not in _WEIGHT_DTYPES:
            return f"experts.{what} is {tensor.dtype} (quantize reads float16, bfloat16, float32 or float64)"
        if tensor.device.type == "meta":
            return f"experts.{what} is on the meta device (no values to quantize)"
    return None


def block_problem(block: torch.nn.Module, *, bits: int, group_size: int, symmetric: bool,
                  scale_dtype: torch.dtype) -> str | None:
    """Why ``block``'s experts cannot be quantized with these settings, in words (naming the expert), or None."""
    problem = _shape_problem(block)
    if problem is not None:
        return problem
    gate_up, down = expert_tensors(block)
    hidden, inter = gate_up.shape[2], down.shape[2]
    try:
        groups = (resolve_group_size(group_size, hidden), resolve_group_size(group_size, inter))
    except ValueError as exc:
        return f"{exc} (hidden={hidden}, intermediate={inter}: both must be divisible)"
    if groups[0] != groups[1]:
        return (f"group_size=-1 makes groups of {groups[0]} rows (hidden) in gate_up_proj and {groups[1]} "
                f"(intermediate) in down_proj; an expert's projections share one group size: give it")
    if bits == 4 and (hidden % 8 or inter % 8):
        return f"int4 packs 8 input rows per word; hidden={hidden}, intermediate={inter}"
    for what, weights in (("gate_up_proj", gate_up), ("down_proj", down)):
        for e in range(weights.shape[0]):
            found = _value_problem(weights[e], bits, groups[0], symmetric, scale_dtype)
            if found is not None:
                return f"experts.{what}[{e}]: {found}"
    return None


def is_moe_like(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds experts as 3-D parameters (a sparse MoE block, whether or not hal runs its type)."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.Module) and any(
        p.dim() >= 3 for p in experts.parameters(recurse=False))


def moe_blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(qualified name, block)`` of every MoE-like block of ``model``, outermost first (none inside another)."""
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if is_moe_like(module):
            inside.append(name)
            yield name, module
