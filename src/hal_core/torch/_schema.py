"""The torch operator schema of an op, derived from its declaration (:class:`hal_core.ops.OpSpec`).

Each op with an output gets two operators: ``hal::<op>`` returns a new tensor, ``hal::<op>_out``
writes a given ``out`` (mutated) and returns nothing; an op without one (``write_kv_cache``) gets
``hal::<op>``, mutating its in-place arguments. An operator with optional mutated arguments
(``rms_norm``'s ``residual``, ``rotary_embedding``'s ``key``) has an overload without them,
``hal::<op>.no_<args>``, which the Python functions call when those are None: inductor cannot
lower a call that leaves an optional mutated argument None. Parameters, in order: the required arguments (a
quantized weight as its tensors ``qweight, scales, zeros, g_idx`` plus ``int bits, int group_size``),
then ``out`` (``_out`` only), then the optional arguments with default None. An op whose weight is
not one :class:`~hal_core.quant.QuantizedWeight` (``fused_moe``'s experts) has no operator.

==============  =========================================
role            torch type
==============  =========================================
array, index    ``Tensor`` (``Tensor?`` when optional; ``Tensor(a!)`` when mutated, ``Tensor(a!)?`` both)
scalar          ``float`` / ``int`` / ``str`` (``float?`` / ``int?`` / ``str?`` when optional)
hint            ``SymInt?``
weight          ``Tensor, Tensor, Tensor?, Tensor?, int, int``
==============  =========================================
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from ..ops import Arg, OpSpec, Role
from ..quant import QuantizedWeight

__all__ = ["TorchOp", "WEIGHT_FIELDS", "torch_ops"]

#: A quantized weight's parameters in a schema, in order (see :mod:`hal_core.torch._weights`).
WEIGHT_FIELDS = ("qweight", "scales", "zeros", "g_idx", "bits", "group_size")
_WEIGHT_TYPES = ("Tensor", "Tensor", "Tensor?", "Tensor?", "int", "int")


@dataclass(frozen=True)
class TorchOp:
    """One ``torch.ops.hal`` operator of an op: its name, schema and parameter names in schema order."""

    spec: OpSpec
    name: str
    schema: str
    params: tuple[str, ...]
    #: True for the ``_out`` variant (writes ``out``, returns nothing).
    writes_out: bool
    #: The optional mutated arguments this overload leaves out (``rms_norm.no_residual``): empty for the full one.
    without: tuple[str, ...] = ()

    @property
    def returns_tensor(self) -> bool:
        return self.spec.output is not None and not self.writes_out


def _param(arg: Arg, alias: str | None) -> str:
    if arg.is_array:
        if alias is not None:  # an optional one (rms_norm's residual, rotary_embedding's key) may be None
            return f"Tensor({alias}!) {arg.name}" if arg.required else f"Tensor({alias}!)? {arg.name}=None"
        return f"Tensor {arg.name}" if arg.required else f"Tensor? {arg.name}=None"
    # a hint may come from traced sizes (a symbolic int under torch.compile), never specialised
    kind = "SymInt" if arg.role is Role.HINT else {int: "int", str: "str"}.get(arg.kind, "float")
    return f"{kind} {arg.name}" if arg.required else f"{kind}? {arg.name}=None"


def torch_ops(spec: OpSpec) -> list[TorchOp]:
    """The operators of ``spec`` (one, or the functional and ``_out`` pair); none for an op whose weight is not
    one :class:`~hal_core.quant.QuantizedWeight` (``fused_moe``'s :class:`~hal_core.quant.ExpertWeights`)."""
    if any(arg.is_weight and arg.kind is not QuantizedWeight for arg in spec.args):
        return []
    if sum(arg.is_weight for arg in spec.args) > 1:
        raise TypeError(f"op {spec.name!r}: torch operators take at most one quantized weight argument")
    found = []
    for writes_out in ([False, True] if spec.output is not None else [False]):
        aliases = iter(string.ascii_lowercase)
        required: list[tuple[str, str]] = []
        optional: list[tuple[str, str]] = []
        for arg in spec.args:
            if arg.role is Role.OUTPUT:
                continue
            if arg.is_weight:
                required += [(f"{t} {n}", n) for t, n in zip(_WEIGHT_TYPES, WEIGHT_FIELDS, strict=True)]
            else:
                text = _param(arg, next(aliases) if arg.mutated else None)
                (required if arg.required else optional).append((text, arg.name))
        out = [(f"Tensor({next(aliases)}!) out", "out")] if writes_out else []
        params = [*required, *out, *optional]
        returns = "Tensor" if spec.output is not None and not writes_out else "()"
        name = f"{spec.name}_out" if writes_out else spec.name
        found.append(TorchOp(spec, name, f"({', '.join(text for text, _ in params)}) -> {returns}",
                             tuple(n for _, n in params), writes_out))
        # An optional mutated argument left None is what inductor cannot lower (torch 2.13: its functionalized
        # call yields a getitem of a non-operator): the same operator without those arguments, for such calls.
        mutable = tuple(n for text, n in optional if "!)?" in text)
        if mutable:
            kept = [(text, n) for text, n in params if n not in mutable]
            found.append(TorchOp(spec, f"{name}.no_{'_'.join(mutable)}",
                                 f"({', '.join(text for text, _ in kept)}) -> {returns}",
                                 tuple(n for _, n in kept), writes_out, mutable))
    return found
