"""``AttentionOptions``: what shapes one attention layer's scores, as one value (``paged_attention``'s group).

An engine builds one per layer from the model's config and passes it unchanged on every call
(``be.ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, options=layer_options)``);
each implementation receives it whole as ``call.options``. The fields are ``paged_attention``'s
arguments of the same names (:mod:`hal_core.ops.paged_attention` gives the formula), checked when the
value is built, so a bad one names its field before any call. A new option is one new field here:
the op's arguments, its torch schema, its coverage variants and the front door follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import dtype_name
from ._declare import Arg, Role
from ._groups import ArgGroup, grouped
from ._validate import host_number

__all__ = ["ATTENTION_OPTIONS", "AttentionOptions"]


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """The softmax scale and the optional score modifiers of one attention layer (None: not used).

    ``sinks`` and ``alibi_slopes`` are float32 ``[num_heads]`` arrays of the backend that runs the calls
    (numpy for the host), so a call converts nothing; their length is checked against the query's heads
    at each call. A value is compared and hashed by identity (its arrays have no single truth value):
    ``dataclasses.replace(options, window=...)`` makes a changed copy.
    """

    scale: float = field(metadata=grouped(
        Arg.scalar("scale", float, doc="the softmax scale (usually head_size ** -0.5)")))
    window: int | None = field(default=None, metadata=grouped(
        Arg.scalar("window", int, required=False, minimum=1,
                   doc="sliding window: a token attends only the last `window` keys up to itself"),
        variant="window"))
    softcap: float | None = field(default=None, metadata=grouped(
        Arg.scalar("softcap", float, required=False, minimum=0, exclusive=True,
                   doc="logit softcap: scores become softcap * tanh(score / softcap)"),
        variant="softcap"))
    sinks: Any = field(default=None, metadata=grouped(
        Arg.array("sinks", "[num_heads]", dtypes=("fp32",), required=False,
                  doc="one extra logit per head in the softmax denominator"),
        variant="sinks"))
    alibi_slopes: Any = field(default=None, metadata=grouped(
        Arg.array("alibi_slopes", "[num_heads]", dtypes=("fp32",), required=False,
                  doc="ALiBi: slope[h] * (t - p) added to the score of key t at position p"),
        variant="alibi"))

    def __post_init__(self) -> None:
        for arg in ATTENTION_OPTIONS.args:
            value = getattr(self, arg.name)
            try:
                if value is None:
                    if arg.required:
                        raise ArgumentTypeError(f"argument {arg.name!r} is required")
                elif arg.role is Role.SCALAR:
                    object.__setattr__(self, arg.name, host_number(arg, value))
                else:
                    _check_vector(arg, value)
            except (ArgumentError, ArgumentTypeError) as exc:
                raise type(exc)(f"AttentionOptions: {exc}") from None


def _check_vector(arg: Arg, value: Any) -> None:
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "dtype"):
        raise ArgumentTypeError(f"argument {arg.name!r}: expected an array {arg.layout}, got {type(value).__name__}")
    if len(shape) != 1:
        raise ArgumentError(f"argument {arg.name!r}: expected 1 dimension {arg.layout}, got shape {tuple(shape)}")
    found = _dtype(value)
    if found not in arg.dtypes:
        raise ArgumentTypeError(f"argument {arg.name!r}: expected dtype {' or '.join(arg.dtypes)}, got {found}")


def _dtype(value: Any) -> str:
    """hal's dtype name of an array of any framework (``torch.float32`` read as ``float32``)."""
    name = dtype_name(value)
    if "." in name:
        try:
            return dtype_name(np.dtype(name.rsplit(".", 1)[1]))
        except TypeError:
            return name
    return name


#: ``paged_attention``'s argument group: the fields of :class:`AttentionOptions`.
ATTENTION_OPTIONS = ArgGroup.of(AttentionOptions)
