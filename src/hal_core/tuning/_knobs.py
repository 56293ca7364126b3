"""Knobs: named parameters of one op implementation, with candidates and a built-in rule."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ._lookup import knob_choice, knob_value

__all__ = ["Knob"]


@dataclass(frozen=True)
class Knob:
    """A tunable parameter of an implementation, e.g. ``Knob("partition_size", (256, 512, 1024), rule)``.

    ``rule(call)`` is the built-in choice (it should return one of
    ``candidates``, though any value is allowed). The implementation reads
    the value for a call with ``knob.value(call)``: the winner ``hal tune``
    persisted for the call's shape bucket on this device, else the rule.
    Register knobs with the implementation:
    ``registry.register(op, fn, name=..., knobs=(knob, ...))``. Names are
    unique per op and backend (the store keys values by op and knob name).
    """

    name: str
    candidates: tuple[Hashable, ...]
    rule: Callable[[Any], Hashable]
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"Knob: name must be a non-empty identifier, got {self.name!r}")
        if not self.candidates:
            raise ValueError(f"Knob {self.name!r}: candidates must not be empty")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"Knob {self.name!r}: candidates must be distinct, got {self.candidates!r}")
        for value in self.candidates:
            if not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"Knob {self.name!r}: candidates must be JSON scalars, got {value!r}")

    def value(self, call: Any) -> Hashable:
        """The value for ``call``: an override (while tuning), the persisted winner, else ``rule(call)``."""
        return knob_value(call, self)

    def chosen(self, call: Any) -> Hashable | None:
        """The value ``hal tune`` chose for ``call`` (an override while tuning, else the persisted winner); None
        where the rule decides (an implementation that applies its rule per part of a call reads this)."""
        return knob_choice(call, self)
