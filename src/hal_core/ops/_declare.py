"""The vocabulary an op is declared in: its arguments and their roles, its coverage features, its benchmark cases.

An op's facts are written once, on its :class:`~hal_core.ops.OpSpec`::

    class Scale(OpSpec):
        name = "scale_rows"
        args = (
            Arg.array("x", "[rows, cols]", dtypes=("fp32", "fp16")),
            Arg.scalar("factor", float),
            Arg.out(),
        )
        output = Output("[rows, cols]", dtype_of="x")

From that declaration hal derives the front door method (``be.ops.scale_rows(x, *, factor, out=None)``),
the argument checks (rank, dtype, layout and the sizes the layouts share), the output's shape and dtype,
the torch schema and fake, what a backend's :class:`~hal_core.ops.OpCoverage` may claim, and the
``hal bench`` / ``hal info --explain`` cases.

Layouts name each dimension; a name used by several arguments is one size, checked across them. A
dimension may be written ``name + 1`` (e.g. ``[num_seqs + 1]``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["Arg", "BenchCases", "Dim", "Feature", "Output", "Role", "parse_layout"]


class Role(enum.Enum):
    """What an argument is to the op (it decides checks, device handling and the torch type)."""

    #: A floating-point array the op reads (or, with ``mutated=True``, writes in place).
    ARRAY = "array"
    #: An integer index array (block tables, lengths, slots): its values are checked on the host.
    INDEX = "index"
    #: A :class:`~hal_core.quant.QuantizedWeight`: its arrays travel with the call as one argument.
    WEIGHT = "weight"
    #: A host number that changes the result (a scale, a window), or one of a few named settings (:meth:`Arg.choice`).
    SCALAR = "scalar"
    #: A host int the caller knows without reading device memory (an upper bound), used to plan work.
    HINT = "hint"
    #: The optional ``out`` array: the result is written there.
    OUTPUT = "output"


@dataclass(frozen=True)
class Dim:
    """One dimension of a layout: a size name plus a constant offset (``num_seqs + 1``)."""

    name: str
    offset: int = 0

    def __str__(self) -> str:
        return self.name if not self.offset else f"{self.name} + {self.offset}"


_DIM = re.compile(r"^\s*([A-Za-z_][A-Za-z_0-9]*)\s*(?:\+\s*(\d+))?\s*$")


def parse_layout(layout: str) -> tuple[Dim, ...]:
    """``'[num_seqs + 1, head_size]'`` as its :class:`Dim` s; raises ValueError on anything else."""
    text = layout.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(f"layout {layout!r}: expected '[dim, dim, ...]'")
    inner = text[1:-1].strip()
    if not inner:
        return ()
    dims = []
    for part in inner.split(","):
        match = _DIM.match(part)
        if match is None:
            raise ValueError(f"layout {layout!r}: cannot read dimension {part.strip()!r} (a name, or 'name + N')")
        dims.append(Dim(match.group(1), int(match.group(2) or 0)))
    return tuple(dims)


@dataclass(frozen=True)
class Arg:
    """One argument of an op, in signature order. Build with the class methods (:meth:`array`, ...)."""

    name: str
    role: Role
    #: Array arguments: the dimension names, e.g. ``'[num_seqs, num_heads, head_size]'``.
    layout: str = ""
    #: Array arguments: accepted hal dtype names.
    dtypes: tuple[str, ...] = ()
    #: Array arguments: must have this other argument's dtype (checked after that one).
    dtype_of: str | None = None
    #: True: C-contiguous; ``'last'``: any non-negative strides with a contiguous last dimension.
    contiguous: bool | Literal["last"] = True
    required: bool = True
    #: Keyword-only in the front door's signature (optional arguments always are).
    keyword_only: bool = False
    #: Written in place by the op (the caches of ``write_kv_cache``).
    mutated: bool = False
    #: Scalars and hints: ``float``, ``int``, or ``str`` (a setting, one of ``choices``); weights: their class.
    kind: type = float
    #: Scalars and hints: the smallest allowed value, and whether it is excluded (``softcap > 0``).
    minimum: float | None = None
    exclusive: bool = False
    doc: str = ""
    #: ``str`` scalars: the accepted values.
    choices: tuple[str, ...] = ()
    dims: tuple[Dim, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Arg: {self.name!r} is not an identifier")
        if self.layout and not self.dims:
            object.__setattr__(self, "dims", parse_layout(self.layout))

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def array(cls, name: str, layout: str, *, dtypes: Sequence[str] = (), dtype_of: str | None = None,
              contiguous: bool | Literal["last"] = True, required: bool = True, mutated: bool = False,
              keyword_only: bool = False, doc: str = "") -> Arg:
        """A floating-point array argument (``dtypes`` or ``dtype_of`` says which dtypes)."""
        return cls(name, Role.ARRAY, layout, tuple(dtypes), dtype_of, contiguous, required,
                   keyword_only or not required, mutated, doc=doc)

    @classmethod
    def index(cls, name: str, layout: str, *, dtypes: Sequence[str] = ("int32",), required: bool = True,
              contiguous: bool | Literal["last"] = True, doc: str = "") -> Arg:
        """An integer index array (values checked on the host by the op's ``check_index_values``)."""
        return cls(name, Role.INDEX, layout, tuple(dtypes), None, contiguous, required, not required, doc=doc)

    @classmethod
    def weight(cls, name: str, layout: str, *, kind: type | None = None, doc: str = "") -> Arg:
        """A :class:`~hal_core.quant.QuantizedWeight` (or another weight class, ``kind``: one with ``shape``,
        ``arrays()`` and ``map_arrays(fn)``, such as :class:`~hal_core.quant.ExpertWeights`); ``layout`` names
        the dimensions of its ``shape``."""
        if kind is None:
            from ..quant import QuantizedWeight

            kind = QuantizedWeight
        return cls(name, Role.WEIGHT, layout, kind=kind, doc=doc)

    @classmethod
    def scalar(cls, name: str, kind: type = float, *, required: bool = True, minimum: float | None = None,
               exclusive: bool = False, doc: str = "") -> Arg:
        """A host number: ``float`` (finite) or ``int``; keyword-only; ``minimum`` bounds it."""
        return cls(name, Role.SCALAR, required=required, keyword_only=True, kind=kind, minimum=minimum,
                   exclusive=exclusive, doc=doc)

    @classmethod
    def choice(cls, name: str, choices: Sequence[str], *, doc: str = "") -> Arg:
        """An optional keyword-only host setting, one of ``choices`` (None: the op's documented default)."""
        if not choices or any(not isinstance(c, str) for c in choices):
            raise ValueError(f"Arg.choice({name!r}): expected a non-empty sequence of strings")
        return cls(name, Role.SCALAR, required=False, keyword_only=True, kind=str, choices=tuple(choices), doc=doc)

    @classmethod
    def hint(cls, name: str, *, doc: str = "") -> Arg:
        """An optional host int >= 1 the caller knows without reading device memory."""
        return cls(name, Role.HINT, required=False, keyword_only=True, kind=int, minimum=1, doc=doc)

    @classmethod
    def out(cls, doc: str = "") -> Arg:
        """The optional ``out`` array; its layout and dtype are the op's :class:`Output`'s."""
        return cls("out", Role.OUTPUT, required=False, keyword_only=True,
                   doc=doc or "an array to write the result into (returned)")

    # -- derived facts --------------------------------------------------------------------------

    @property
    def is_array(self) -> bool:
        """Whether the argument is one array (ARRAY, INDEX or OUTPUT)."""
        return self.role in (Role.ARRAY, Role.INDEX, Role.OUTPUT)

    @property
    def is_weight(self) -> bool:
        """Whether the argument is a quantized weight (its arrays travel together)."""
        return self.role is Role.WEIGHT

    @property
    def default(self) -> Any:
        """The front door's default for an optional argument (None)."""
        return None


@dataclass(frozen=True)
class Output:
    """The array an op returns: its layout (names bound by the arguments) and whose dtype it has.

    The dtype is an argument's (``dtype_of``), or a fixed hal dtype name (``dtype='int64'``: token ids).
    """

    layout: str
    dtype_of: str = ""
    dims: tuple[Dim, ...] = field(default=(), compare=False)
    #: A fixed hal dtype name, given instead of ``dtype_of``.
    dtype: str = ""

    def __post_init__(self) -> None:
        if bool(self.dtype_of) == bool(self.dtype):
            raise ValueError(f"Output {self.layout!r}: give exactly one of dtype_of and dtype")
        if not self.dims:
            object.__setattr__(self, "dims", parse_layout(self.layout))


@dataclass(frozen=True)
class Feature:
    """A property of a call that a backend's :class:`~hal_core.ops.OpCoverage` may constrain.

    ``field`` is the ``OpCoverage`` keyword (``head_sizes``); ``get(args)`` the call's value (``128``),
    or, with ``many=True``, a set of values that must all be declared (the attention variants a call
    uses: ``{"prefill", "window"}``). A call whose value is one of ``opt_in`` goes to a backend's own
    implementations only when that backend declares the value (``quantized_gemm``'s ``'w4a8'``).
    """

    name: str
    field: str
    get: Callable[[Mapping[str, Any]], Any]
    many: bool = False
    doc: str = ""
    #: Values a backend's implementations are given only where its coverage declares them: a setting an
    #: implementation written before it would not know of (and so silently ignore); elsewhere the call
    #: falls back.
    opt_in: tuple[Hashable, ...] = ()


@dataclass(frozen=True)
class BenchCases:
    """What ``hal bench``, ``hal tune`` and ``hal info --explain`` need of an op.

    - ``params``: every benchmark parameter with its default (ints >= 1, or a dtype name for ``dtype``;
      the names in ``may_be_zero`` may also be 0); ``aliases`` maps other spellings to them.
    - ``label(params)``: a short human name of a case; ``check(params)``: why a case is invalid, or None.
    - ``inputs(rng, params)``: fast host inputs of a case (realistic layout, no reference run).
    - ``presets``: preset name → the parameter sets of that preset (defaults filled in).
    - ``explain``: parameter sets ``hal info --explain`` shows.
    - ``test_inputs(rng, params)``: host inputs with poison where the op must not read (``--explain``
      validates them exactly as a call would).
    - ``tiny``: parameters of the smallest realistic call, on which ``hal bench`` measures what a call
      costs above its kernel (the front door, ``torch.ops.hal``).
    """

    params: Mapping[str, int | str]
    label: Callable[[Mapping[str, Any]], str]
    inputs: Callable[[np.random.Generator, Mapping[str, Any]], dict[str, Any]]
    check: Callable[[Mapping[str, Any]], str | None] = field(default=lambda params: None)
    aliases: Mapping[str, str] = field(default_factory=dict)
    may_be_zero: frozenset[str] = frozenset()
    presets: Mapping[str, Callable[[], Sequence[Mapping[str, Any]]]] = field(default_factory=dict)
    explain: Sequence[Mapping[str, Any]] = ()
    test_inputs: Callable[[np.random.Generator, Mapping[str, Any]], dict[str, Any]] | None = None
    tiny: Mapping[str, Any] | None = None


#: A bucket function: the shape class of a validated call (``'fp16:b8:ctx4096'``), from shapes only.
Bucket = Callable[[Mapping[str, Any]], Hashable]
