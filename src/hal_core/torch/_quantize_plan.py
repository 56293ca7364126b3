"""Which linear layers :func:`quantize_model` replaces, where each one sits, and at how many bits.

A layer is one ``nn.Linear`` object, however many times the model holds
it: every ``(parent, attribute)`` that refers to it is one of its places,
and every qualified name that reaches it one of its names (the first, in
``named_modules`` order, is the name it is reported under; the others are
its aliases). Its weight is *tied* when a parameter that is not this
layer's own (an embedding, another layer) is the same tensor.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .._errors import ArgumentError, ArgumentTypeError

__all__ = ["Layer", "Plan", "bits_chooser", "plan_layers", "skip_predicate"]

#: Name patterns (fnmatch), or ``skip(name, linear) -> bool``.
SkipArg = Iterable[str] | Callable[[str, torch.nn.Linear], bool] | None
#: Name pattern (fnmatch) -> bits, the first matching pattern winning.
LayerBitsArg = Mapping[str, int] | None


@dataclass
class Layer:
    """One distinct ``nn.Linear`` to quantize: its names, every place that holds it, its bits, tied parameters."""

    linear: torch.nn.Linear
    names: list[str]
    places: list[tuple[torch.nn.Module, str]]
    bits: int = 4
    tied: list[str] = field(default_factory=list)  #: names of other parameters that are this layer's weight

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class Plan:
    """The layers to quantize (in model order) and the names of the linear layers left in float."""

    layers: list[Layer]
    skipped: list[str]


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _patterns(argument: str, patterns: Iterable[object]) -> tuple[str, ...]:
    patterns = tuple(patterns)
    if not all(isinstance(p, str) for p in patterns):
        raise ArgumentTypeError(f"argument {argument!r}: expected name patterns (strings), got {patterns!r}")
    return patterns  # type: ignore[return-value]


def skip_predicate(skip: SkipArg) -> Callable[[str, torch.nn.Linear], bool]:
    """``skip`` as a predicate; a pattern matches a qualified name or its tail (``lm_head`` matches ``x.lm_head``)."""
    if skip is None:
        return lambda name, linear: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        skip = (skip,)
    try:
        patterns = _patterns("skip", skip)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"argument 'skip': expected name patterns (strings), a callable "
                                f"(name, linear) -> bool or None, got {skip!r}") from None
    return lambda name, linear: any(_matches(name, p) for p in patterns)


def bits_chooser(bits: int, layer_bits: LayerBitsArg) -> Callable[[list[str]], int]:
    """``names -> bits``: the first ``layer_bits`` pattern matching any of a layer's names, else ``bits``."""
    if layer_bits is None:
        return lambda names: bits
    if not isinstance(layer_bits, Mapping):
        raise ArgumentTypeError(f"argument 'layer_bits': expected a mapping of name patterns to bits "
                                f"(e.g. {{'lm_head': 8}}) or None, got {type(layer_bits).__name__}")
    _patterns("layer_bits", layer_bits)
    for pattern, value in layer_bits.items():
        if value not in (4, 8) or isinstance(value, bool):
            raise ArgumentError(f"argument 'layer_bits': expected 4 or 8 for {pattern!r}, got {value!r}")
    rules = tuple(layer_bits.items())

    def choose(names: list[str]) -> int:
        for pattern, value in rules:
            if any(_matches(name, pattern) for name in names):
                return int(value)
        return bits

    return choose


def plan_layers(model: torch.nn.Module, skip: Callable[[str, torch.nn.Linear], bool],
                bits_for: Callable[[list[str]], int]) -> Plan:
    """Every exact ``nn.Linear`` of ``model`` with all its places and names; the skipped ones by first name.

    A layer is skipped when ``skip`` holds for any of its names, or when it
    is a subclass of ``nn.Linear`` (its weight may be read by more than its
    forward: ``nn.MultiheadAttention`` reads ``out_proj.weight``).
    """
    found: dict[int, Layer] = {}
    seen: set[tuple[int, str]] = set()
    for parent, attr, name, child in _children(model, ""):
        if not isinstance(child, torch.nn.Linear):
            continue
        layer = found.setdefault(id(child), Layer(child, [], []))
        layer.names.append(name)
        if (id(parent), attr) not in seen:
            seen.add((id(parent), attr))
            layer.places.append((parent, attr))
    layers, skipped = [], []
    for layer in found.values():
        if type(layer.linear) is not torch.nn.Linear or any(skip(n, layer.linear) for n in layer.names):
            skipped.append(layer.name)
            continue
        layer.bits = bits_for(layer.names)
        layers.append(layer)
    _find_tied(model, layers)
    return Plan(layers, skipped)


def _children(module: torch.nn.Module, prefix: str) -> Iterator[tuple[torch.nn.Module, str, str, torch.nn.Module]]:
    """``(parent, attribute, qualified name, child)`` of every path to every submodule, depth first.

    Unlike ``named_children`` / ``named_modules``, a module reached twice
    (under one parent or two) is yielded at each of its places.
    """
    for attr, child in module._modules.items():
        if child is not None:
            yield module, attr, prefix + attr, child
            yield from _children(child, f"{prefix}{attr}.")


def _find_tied(model: torch.nn.Module, layers: list[Layer]) -> None:
    """Fill ``layer.tied``: the names of parameters, not the layer's own weight, that are its weight tensor."""
    holders: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(parameter), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        holders.setdefault(id(buffer), []).append(name)
    for layer in layers:
        own = {f"{n}.weight" for n in layer.names}
        layer.tied = [n for n in holders.get(id(layer.linear.weight), []) if n not in own]
