"""Argument groups: several of an op's arguments declared, passed and received as one frozen value.

A group is a frozen dataclass whose fields each carry their :class:`~hal_core.ops.Arg` and, optionally, the
coverage variant a call using it needs (:func:`grouped` makes the field's metadata)::

    @dataclass(frozen=True)
    class AttentionOptions:
        scale: float = field(metadata=grouped(Arg.scalar("scale", float)))
        window: int | None = field(default=None, metadata=grouped(Arg.scalar("window", int, required=False,
                                                                             minimum=1), variant="window"))

An op declaring the group (``options = ArgGroup.of(AttentionOptions)`` on its
:class:`~hal_core.ops.OpSpec`) gets the fields as its last arguments, so everything derived from the
arguments (validation, the torch schema, coverage variants) follows a new field. The front door takes
either the group's value (``options=...``) or its fields as flat keywords, never both; an
implementation reads the whole value as ``call.options``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ArgumentError, ArgumentTypeError
from ._declare import Arg

__all__ = ["ArgGroup", "grouped"]


def grouped(arg: Arg, *, variant: str | None = None) -> dict[str, Any]:
    """The metadata of a group value's field: it is argument ``arg``, and a call giving it uses coverage
    ``variant`` (``dataclasses.field(default=None, metadata=grouped(Arg.scalar("window", int, ...)))``)."""
    return {"arg": arg, "variant": variant}


@dataclass(frozen=True)
class ArgGroup:
    """The arguments of an op that travel as one value of ``value_type`` (keyword ``name`` on the front door)."""

    value_type: type
    #: The fields' arguments, in field order (appended to the op's arguments).
    args: tuple[Arg, ...]
    #: ``(field, variant)`` for each field naming the coverage variant a call giving it uses.
    variants: tuple[tuple[str, str], ...]
    #: The front door keyword, and the :class:`~hal_core.ops.OpCall` attribute, holding the value.
    name: str = "options"

    @classmethod
    def of(cls, value_type: type, *, name: str = "options") -> ArgGroup:
        """The group declared by the fields of frozen dataclass ``value_type`` (see the module docs)."""
        fields = dataclasses.fields(value_type)
        args, variants = [], []
        for f in fields:
            arg = f.metadata.get("arg")
            if not isinstance(arg, Arg) or arg.name != f.name:
                raise TypeError(f"{value_type.__name__}.{f.name}: declare it with metadata=grouped(Arg...({f.name!r}))")
            args.append(arg)
            if f.metadata.get("variant"):
                variants.append((f.name, f.metadata["variant"]))
        return cls(value_type, tuple(args), tuple(variants), name)

    @property
    def names(self) -> tuple[str, ...]:
        """The fields' names (the flat keywords)."""
        return tuple(arg.name for arg in self.args)

    def used_variants(self, args: Mapping[str, Any]) -> set[str]:
        """The coverage variants of the fields a call gives (not None)."""
        return {variant for name, variant in self.variants if args.get(name) is not None}

    def merge(self, args: dict[str, Any], value: Any) -> dict[str, Any]:
        """``args`` with the fields of ``value`` filled in; an error when a field was also given flat."""
        if not isinstance(value, self.value_type):
            raise ArgumentTypeError(f"argument {self.name!r}: expected a {self.value_type.__name__}, "
                                    f"got {type(value).__name__}")
        both = [name for name in self.names if args.get(name) is not None]
        if both:
            listed = ", ".join(repr(name) for name in both)
            raise ArgumentError(f"arguments {listed} and {self.name!r}: give {listed} inside {self.name!r} "
                                f"({self.value_type.__name__}) or as keywords, not both")
        for name in self.names:
            args[name] = getattr(value, name)
        return args

    def value_of(self, args: Mapping[str, Any], given: Any = None) -> Any:
        """The group value of validated ``args``: ``given`` itself when its fields are the arguments' values
        (the caller's object, passed through), else a new value of them (not validated again)."""
        names = self.names
        if given is not None and all(_same(args.get(name), getattr(given, name)) for name in names):
            return given
        value: Any = object.__new__(self.value_type)
        for name in names:
            object.__setattr__(value, name, args.get(name))
        return value

    def flat(self, value: Any) -> dict[str, Any]:
        """The fields of a group value as flat keyword arguments."""
        return {name: getattr(value, name) for name in self.names}


def _same(found: Any, held: Any) -> bool:
    """Whether a validated argument is the group field it came from (host numbers may be normalised copies)."""
    return found is held or (type(found) in (int, float) and type(held) in (int, float) and found == held)
