"""Per-backend registry of op implementations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._spec import OpCall, OpImpl

if TYPE_CHECKING:
    from ..tuning import Knob

__all__ = ["OpRegistry"]


class OpRegistry:
    """The implementations one backend offers, per op, best first."""

    def __init__(self, known_ops: frozenset[str]) -> None:
        self._known = known_ops
        self._impls: dict[str, list[OpImpl]] = {}

    def register(
        self,
        op: str | OpImpl,
        fn: Callable[[OpCall], Any] | None = None,
        *,
        priority: int = 0,
        supports: Callable[[OpCall], bool | str] | None = None,
        name: str = "",
        knobs: Sequence[Knob] = (),
    ) -> OpImpl:
        """Register an implementation; pass an :class:`OpImpl` or its fields (``knobs``: its tunables)."""
        if isinstance(op, OpImpl):
            impl = op
        else:
            if fn is None:
                raise TypeError("register(op, fn): fn is required")
            extra = {"supports": supports} if supports is not None else {}
            impl = OpImpl(op=op, fn=fn, priority=priority, name=name, knobs=tuple(knobs), **extra)
        if impl.op not in self._known:
            raise ValueError(f"unknown op {impl.op!r}; known: {sorted(self._known)}")
        names = [k.name for k in impl.knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"implementation {impl.name!r}: knob names must be distinct, got {names}")
        impls = self._impls.setdefault(impl.op, [])
        impls.append(impl)
        impls.sort(key=lambda i: -i.priority)
        return impl

    def implementations(self, op: str) -> list[OpImpl]:
        """Implementations of ``op``, highest priority first."""
        return list(self._impls.get(op, ()))

    def ops(self) -> list[str]:
        return sorted(self._impls)
