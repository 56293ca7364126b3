"""The sparse MoE blocks :func:`quantize_model` replaces by :class:`QuantMoE`, checked before any is touched.

A block is one module object however many places hold it (as for linear
layers, :mod:`._quantize_plan`). Blocks of the types hal runs
(:data:`._moe_block.BLOCKS`) are planned with their config's settings; other
modules holding experts as 3-D parameters, and blocks of a model without a
config to read, stay in float and are reported with the reason. ``skip``
applies to a block by its names (a predicate is called with the block);
``layer_bits`` patterns choose its bits by the same names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._moe import QuantMoE, quantize_block
from ._moe_block import BLOCKS, MoeSettings, block_problem, expert_tensors, moe_blocks, moe_settings
from ._quantize_plan import _children

__all__ = ["MoeBlock", "MoePlan", "block_problems", "plan_moe", "quantize_blocks", "replace_blocks"]

log = logging.getLogger("hal")


@dataclass
class MoeBlock:
    """One distinct sparse MoE block to replace: its names, every place that holds it, its settings and bits."""

    block: torch.nn.Module
    names: list[str]
    settings: MoeSettings
    bits: int
    places: list[tuple[torch.nn.Module, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.names[0]

    def describe(self) -> str:
        experts, *_ = expert_tensors(self.block)[0].shape
        return f"MoE block {self.name!r} ({type(self.block).__name__}, {experts} experts, int{self.bits})"


@dataclass
class MoePlan:
    """The blocks to replace (in model order) and ``(name, why)`` of the MoE blocks left in float."""

    blocks: list[MoeBlock]
    skipped: list[tuple[str, str]]


def plan_moe(model: torch.nn.Module, skip: Callable[[str, Any], bool],
             bits_for: Callable[[list[str]], int]) -> MoePlan:
    """Every MoE-like block of ``model``: those hal runs with their settings (a ConfigurationError names a
    config field it cannot run), the others left in float with the reason."""
    config = getattr(model, "config", None)
    found: dict[int, MoeBlock] = {}
    skipped: list[tuple[str, str]] = []
    for name, block in moe_blocks(model):
        cls = type(block).__name__
        if cls not in BLOCKS:
            skipped.append((name, f"{cls} is not a sparse MoE block hal runs ({', '.join(BLOCKS)})"))
        elif config is None:
            skipped.append((name, "the model has no config to read num_experts_per_tok and hidden_act from "
                                  "(quantize the transformers model itself)"))
        elif skip(name, block) or skip(f"{name}.experts", block):
            skipped.append((name, "skipped by 'skip'"))
        else:
            found[id(block)] = MoeBlock(block, [name], moe_settings(block, config, name), 4)
    for parent, attr, name, child in _children(model, ""):
        planned = found.get(id(child))
        if planned is not None:
            if name not in planned.names:
                planned.names.append(name)
            if (parent, attr) not in planned.places:
                planned.places.append((parent, attr))
    for planned in found.values():
        planned.bits = bits_for(planned.names)
    return MoePlan(list(found.values()), skipped)


def block_problems(plan: MoePlan, *, group_size: int, symmetric: bool, scale_dtype: torch.dtype) -> list[str]:
    """Each planned block that cannot be quantized with these settings, described with its problem."""
    return [f"{planned.describe()}: {problem}" for planned in plan.blocks
            if (problem := block_problem(planned.block, bits=planned.bits, group_size=group_size,
                                         symmetric=symmetric, scale_dtype=scale_dtype)) is not None]


def quantize_blocks(plan: MoePlan, *, group_size: int, symmetric: bool, scale_dtype: torch.dtype,
                    step: Callable[[str], None],
                    activations: str | None = None) -> tuple[list[QuantMoE], int, int]:
    """``(the new modules, the experts' float bytes, their quantized bytes)`` for a plan whose
    :func:`block_problems` found nothing; nothing in the model changed yet. ``activations``: each new block's
    (:class:`QuantMoE`)."""
    done: list[QuantMoE] = []
    float_bytes = quantized_bytes = 0
    for planned in plan.blocks:
        module = quantize_block(planned.block, planned.settings, bits=planned.bits, group_size=group_size,
                                symmetric=symmetric, scale_dtype=scale_dtype, name=planned.name,
                                activations=activations)
        done.append(module)
        float_bytes += sum(t.numel() * t.element_size() for t in expert_tensors(planned.block))
        quantized_bytes += sum(t.numel() * t.element_size() for t in module.buffers())
        step(planned.name)
    return done, float_bytes, quantized_bytes


def replace_blocks(plan: MoePlan, modules: list[QuantMoE]) -> None:
    """Put each new module at every place of its block."""
    for planned, module in zip(plan.blocks, modules, strict=True):
        for parent, attr in planned.places:
            setattr(parent, attr, module)
        log.debug("hal: quantized the experts of %s to int%d", planned.name, planned.bits)
