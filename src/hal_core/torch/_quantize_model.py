"""Quantizing a model in place: every ``nn.Linear`` becomes a :class:`QuantLinear`.

Three passes, so that an error leaves the model as it was:

1. every selected layer is checked (:func:`._quantize_checks.layer_problem`:
   shapes, dtypes, group size, finite values, scales in range), reading the
   weights block by block; every problem found is raised at once, each
   naming its layer;
2. each layer is quantized into a new :class:`QuantLinear`, nothing in the
   model changed yet (an error here, e.g. out of memory, leaves it whole);
3. every place that holds a layer gets its ``QuantLinear``, and hal drops
   its last reference to the float layers, whose weights go with them
   (unless something else holds them: a weight tied to an embedding).

Then the float tensors that remain and live in a file mapping (a
checkpoint mapped by ``from_pretrained``) are copied out of it, so the
mapping and its resident pages go, and the C heap's free pages are handed
back to the system (:mod:`._release`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from .._errors import ArgumentError, ArgumentTypeError
from ..quant._args import as_bool, as_int
from ._layer_progress import ProgressArg, layer_progress
from ._modules import _SCALE_DTYPES, QuantLinear, check_activations
from ._quantize_checks import layer_problem
from ._quantize_moe import block_problems, plan_moe, quantize_blocks, replace_blocks
from ._quantize_plan import Layer, LayerBitsArg, SkipArg, bits_chooser, plan_layers, skip_predicate
from ._release import move_out_of_file_mappings, return_free_heap

__all__ = ["DEFAULT_LAYER_BITS", "DEFAULT_SKIP", "QuantizeReport", "quantize_model"]

log = logging.getLogger("hal")

#: Name patterns left in float by default: none (``lm_head`` is quantized at 8 bits, :data:`DEFAULT_LAYER_BITS`).
DEFAULT_SKIP: tuple[str, ...] = ()

#: Bits by name pattern, by default: the output projection at 8 bits (W8A8), whatever ``bits`` the rest gets.
#: Chosen by ``benchmarks/lm_head_accuracy.py`` (docs/quantization.md, "The output projection").
DEFAULT_LAYER_BITS: Mapping[str, int] = MappingProxyType({"lm_head": 8})


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_model` did: layer names, their bits, and the bytes of their weights before and after.

    A layer held at several places is quantized once and reported under its
    first name (``named_modules`` order); ``aliases`` pairs each other name
    with it. ``tied`` pairs a quantized layer with each parameter that
    shared its float weight (an embedding tied to ``lm_head``): that
    parameter keeps the float weight, so those bytes are not freed.
    """

    quantized: tuple[str, ...]
    skipped: tuple[str, ...]
    float_bytes: int      #: the quantized layers' float weights (and biases), as they were
    quantized_bytes: int  #: the same layers now: packed weights, scales, zero points, g_idx, biases
    bits: tuple[int, ...] = ()                  #: each quantized layer's bits, in the order of ``quantized``
    aliases: tuple[tuple[str, str], ...] = ()   #: (another name of a quantized layer, the name it is reported under)
    tied: tuple[tuple[str, str], ...] = ()      #: (quantized layer, parameter still holding its float weight)
    unmapped_bytes: int = 0  #: float tensors copied out of file mappings (so the mapped checkpoint could go)
    moe_blocks: tuple[str, ...] = ()  #: sparse MoE blocks whose experts became a :class:`QuantMoE`
    moe_bits: tuple[int, ...] = ()    #: each block's bits, in the order of ``moe_blocks``
    moe_float_bytes: int = 0          #: those blocks' float expert weights, as they were (routers excluded)
    moe_quantized_bytes: int = 0      #: the same experts now (the QuantMoE buffers)
    moe_skipped: tuple[tuple[str, str], ...] = ()  #: (MoE block left in float, why)


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _check_arguments(model: object, bits: object, group_size: object, symmetric: object,
                     scale_dtype: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ArgumentError(f"argument 'bits': expected 4 or 8, got {bits!r}")
    size = as_int("group_size", group_size)
    if size <= 0 and size != -1:
        raise ArgumentError(f"argument 'group_size': expected a positive size or -1 (one group), got {size}")
    as_bool("symmetric", symmetric)
    if scale_dtype not in _SCALE_DTYPES:
        raise ArgumentTypeError(f"argument 'scale_dtype': expected torch.float16, torch.bfloat16 or "
                                f"torch.float32, got {scale_dtype}")


def _describe(layer: Layer) -> str:
    linear = layer.linear
    return f"layer {layer.name!r} ({linear.in_features} -> {linear.out_features}, int{layer.bits})"


def quantize_model(model: torch.nn.Module, *, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                   scale_dtype: torch.dtype = torch.float16, layer_bits: LayerBitsArg = DEFAULT_LAYER_BITS,
                   skip: SkipArg = DEFAULT_SKIP, unmap: bool = True, progress: ProgressArg = None,
                   activations: str | None = "auto") -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantLinear` (:meth:`QuantLinear.from_linear`), in place.

    ``bits``: 4 (W4A16) or 8 (W8A8) for every layer that ``layer_bits``
    does not name. ``layer_bits``: name patterns to bits, the first
    pattern matching a layer's name winning (default ``{"lm_head": 8}``:
    the output projection in int8, whose error every token's logits see;
    None gives every layer ``bits``). ``skip``: name patterns left in
    float (default none), a predicate ``skip(name, linear)``, or None.
    Patterns are ``fnmatch`` patterns matched against the qualified module
    name or its tail (``"lm_head"``, ``"*.mlp.down_proj"``); a layer with
    several names matches when any of them does. ``unmap``: copy the float
    tensors left in a file mapping (a checkpoint mapped by
    ``from_pretrained``) to memory of their own, so the mapping is
    released. ``progress``: None, True (a progress bar on stderr) or
    ``progress(done, total, name)``, called after each layer is quantized.
    ``activations``: every new layer's and MoE block's activation precision
    (:class:`QuantLinear`, :class:`QuantMoE`): None or ``"float"`` (W4A16
    for int4 layers), ``"int8"`` (int4 layers run as W4A8 on integer dot
    products; docs/quantization.md gives its accuracy), ``"auto"`` (the
    default: the backend chooses per call); int8 layers are W8A8 either way.

    Only exact ``nn.Linear`` submodules of ``model`` are quantized:
    subclasses are left in float (and listed as skipped), since their
    weight may be read by more than their forward. Every layer is checked
    before any is changed (shape and dtype, ``in_features`` against
    ``group_size`` and int4's packing, weights present and finite, scales
    that ``scale_dtype`` can hold): ``hal_core.ArgumentError`` (a
    ``ValueError``) names each layer that cannot be quantized, and the model
    is left as it was after any error. A layer held at several places is
    quantized once and every place gets the same ``QuantLinear``. Layers
    stay on their devices. Returns a :class:`QuantizeReport`.

    Sparse MoE blocks of a transformers model (Qwen3-MoE, Mixtral) become a
    :class:`QuantMoE` each (:mod:`._quantize_moe`): every expert quantized
    with ``bits`` (or its ``layer_bits`` pattern), ``group_size``,
    ``symmetric`` and ``scale_dtype``, the router kept in float, the
    settings read from ``model.config`` (a ``ConfigurationError`` names a
    field it lacks); no float expert weight is kept. ``skip`` leaves a block
    in float by its name. Other MoE block types stay in float and are listed
    in ``moe_skipped`` with the reason.
    """
    _check_arguments(model, bits, group_size, symmetric, scale_dtype)
    try:
        activations = check_activations(activations)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    unmap = bool(as_bool("unmap", unmap))
    skips, bits_for = skip_predicate(skip), bits_chooser(bits, layer_bits)
    plan = plan_layers(model, skips, bits_for)
    moe = plan_moe(model, skips, bits_for)
    problems = [f"{_describe(layer)}: {problem}" for layer in plan.layers
                if (problem := layer_problem(layer.linear, bits=layer.bits, group_size=group_size,
                                             symmetric=symmetric, scale_dtype=scale_dtype)) is not None]
    problems += block_problems(moe, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    if problems:
        raise ArgumentError(f"quantize_model: {len(problems)} layer(s) cannot be quantized, nothing was changed "
                            f"(leave a layer in float with skip=): " + "; ".join(problems))

    done: list[QuantLinear] = []
    float_bytes = quantized_bytes = 0
    with layer_progress(progress, len(plan.layers) + len(moe.blocks), "quantizing") as step:
        for layer in plan.layers:
            try:
                quantized = QuantLinear.from_linear(layer.linear, bits=layer.bits, group_size=group_size,
                                                    symmetric=symmetric, scale_dtype=scale_dtype,
                                                    name=layer.name, activations=activations)
            except ValueError as exc:
                raise ArgumentError(f"quantize_model: {_describe(layer)} cannot be quantized, nothing was "
                                    f"changed: {exc}") from exc
            done.append(quantized)
            float_bytes += _nbytes(layer.linear)
            quantized_bytes += _nbytes(quantized)
            step(layer.name)
        blocks, moe_float, moe_quantized = quantize_blocks(moe, group_size=group_size, symmetric=symmetric,
                                                           scale_dtype=scale_dtype, step=step,
                                                           activations=activations)
    replace_blocks(moe, blocks)
    for layer, quantized in zip(plan.layers, done, strict=True):
        for parent, attr in layer.places:
            setattr(parent, attr, quantized)
        log.debug("hal: quantized %s to int%d", layer.name, layer.bits)
    report = QuantizeReport(
        quantized=tuple(layer.name for layer in plan.layers), skipped=tuple(plan.skipped),
        float_bytes=float_bytes, quantized_bytes=quantized_bytes, bits=tuple(layer.bits for layer in plan.layers),
        aliases=tuple((alias, layer.name) for layer in plan.layers for alias in layer.names[1:]),
        tied=tuple((layer.name, other) for layer in plan.layers for other in layer.tied),
        moe_blocks=tuple(b.name for b in moe.blocks), moe_bits=tuple(b.bits for b in moe.blocks),
        moe_float_bytes=moe_float, moe_quantized_bytes=moe_quantized, moe_skipped=tuple(moe.skipped))
    del plan, done, moe, blocks  # hal's last references to the float layers and experts: their weights go now
    if unmap:
        report = replace(report, unmapped_bytes=move_out_of_file_mappings(model))
    return_free_heap()
    _log(report, group_size)
    return report


def _log(report: QuantizeReport, group_size: int) -> None:
    widths = sorted(set(report.bits))
    log.info("hal: quantized %d linear layers to %s (group size %s): %.1f MB -> %.1f MB; left in float: %s%s%s",
             len(report.quantized), "/".join(f"int{b}" for b in widths) or "nothing", group_size,
             report.float_bytes / 1e6, report.quantized_bytes / 1e6, ", ".join(report.skipped) or "none",
             "".join(f"; {layer} also at {', '.join(a for a, n in report.aliases if n == layer)}"
                     for layer in dict.fromkeys(n for _, n in report.aliases)),
             "".join(f"; {other} keeps {layer}'s float weight" for layer, other in report.tied))
    if report.moe_blocks or report.moe_skipped:
        log.info("hal: quantized the experts of %d MoE blocks (%s): %.1f MB -> %.1f MB%s", len(report.moe_blocks),
                 "/".join(f"int{b}" for b in sorted(set(report.moe_bits))) or "none",
                 report.moe_float_bytes / 1e6, report.moe_quantized_bytes / 1e6,
                 "".join(f"; {name} left in float: {why}" for name, why in report.moe_skipped))
