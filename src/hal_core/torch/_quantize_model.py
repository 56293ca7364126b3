"""Quantizing a model in place: every ``nn.Linear`` becomes a :class:`QuantLinear`.

The layers are quantized one at a time, each replaced in its parent as
soon as it is done, and no reference to the float layer is kept: its
weight is freed then (unless something else holds it, e.g. a weight tied
to an embedding), so the peak stays near the float model plus one layer's
transient (the float64 host copy :func:`hal_core.quant.quantize` works on).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ._layer_progress import ProgressArg, layer_progress
from ._modules import QuantLinear, resolve_group_size

__all__ = ["DEFAULT_SKIP", "QuantizeReport", "quantize_model"]

log = logging.getLogger("hal")

#: Name patterns left in float by default: the output projection, whose error every token's logits see.
DEFAULT_SKIP = ("lm_head",)

#: Name patterns (fnmatch), or ``skip(name, linear) -> bool``.
SkipArg = Iterable[str] | Callable[[str, torch.nn.Linear], bool] | None


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_model` did: layer names, and the bytes of their weights before and after."""

    quantized: tuple[str, ...]
    skipped: tuple[str, ...]
    float_bytes: int      #: the quantized layers' float weights (and biases), as they were
    quantized_bytes: int  #: the same layers now: packed weights, scales, zero points, g_idx, biases


def skip_predicate(skip: SkipArg) -> Callable[[str, torch.nn.Linear], bool]:
    """``skip`` as a predicate; a pattern matches a qualified name or its tail (``lm_head`` matches ``x.lm_head``)."""
    if skip is None:
        return lambda name, linear: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        skip = (skip,)
    patterns = tuple(skip)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"argument 'skip': expected name patterns (strings), a callable (name, linear) -> bool "
                        f"or None, got {patterns!r}")
    return lambda name, linear: any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p)
                                    for p in patterns)


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def quantize_model(model: torch.nn.Module, *, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                   scale_dtype: torch.dtype = torch.float16, skip: SkipArg = DEFAULT_SKIP,
                   progress: ProgressArg = None) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantLinear` (:meth:`QuantLinear.from_linear`), in place.

    ``skip``: name patterns (``fnmatch``, matched against the qualified
    module name or its tail; default ``("lm_head",)``), or a predicate
    ``skip(name, linear)``, or None to quantize every linear layer.
    ``progress``: None, True (a progress bar on stderr) or
    ``progress(done, total, name)``, called after each layer.

    Only exact ``nn.Linear`` submodules of ``model`` are quantized:
    subclasses are left in float (and listed as skipped), since their
    weight may be read by more than their forward. Every layer is checked
    first (``in_features`` against ``group_size`` and int4's packing,
    values present): a layer that cannot be quantized raises ``ValueError``
    naming it, before any layer is changed. The quantized layers stay on
    their devices; a layer used at several places is quantized once.
    Returns a :class:`QuantizeReport`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"argument 'bits': expected 4 or 8, got {bits!r}")
    predicate = skip_predicate(skip)
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # one entry per distinct layer, every place it sits
    names: dict[int, str] = {}
    skipped: list[str] = []
    left: set[int] = set()  # the skipped layers, once each
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            if not isinstance(child, torch.nn.Linear):
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            if id(child) in places:
                places[id(child)].append((parent, attr))
                continue
            if id(child) in left:
                continue
            # a subclass may be read by more than its forward (nn.MultiheadAttention reads out_proj.weight)
            if type(child) is not torch.nn.Linear or predicate(name, child):
                left.add(id(child))
                skipped.append(name)
                continue
            try:
                resolve_group_size(group_size, child.in_features)
                if bits == 4 and child.in_features % 8:
                    raise ValueError(f"int4 packs 8 input rows per word; in_features={child.in_features}")
                if child.weight.device.type == "meta":
                    raise ValueError("its weight is on the meta device (no values to quantize)")
            except ValueError as exc:
                raise ValueError(f"quantize_model: layer {name!r} ({child.in_features} -> {child.out_features}) "
                                 f"cannot be quantized: {exc}; leave it in float with skip=") from None
            places[id(child)] = [(parent, attr)]
            names[id(child)] = name
    float_bytes = quantized_bytes = 0
    with layer_progress(progress, len(places), "quantizing") as step:
        for key in list(places):
            parent, attr = places[key][0]
            linear = getattr(parent, attr)
            float_bytes += _nbytes(linear)
            layer = QuantLinear.from_linear(linear, bits=bits, group_size=group_size, symmetric=symmetric,
                                            scale_dtype=scale_dtype)
            quantized_bytes += _nbytes(layer)
            for parent, attr in places.pop(key):
                setattr(parent, attr, layer)
            del linear  # the last reference hal held: the float weight goes now, not at the end
            step(names[key])
            log.debug("hal: quantized %s to int%d", names[key], bits)
    report = QuantizeReport(tuple(names.values()), tuple(skipped), float_bytes, quantized_bytes)
    log.info("hal: quantized %d linear layers to int%d (group size %s): %.1f MB -> %.1f MB; left in float: %s",
             len(report.quantized), bits, group_size, float_bytes / 1e6, quantized_bytes / 1e6,
             ", ".join(skipped) or "none")
    return report
