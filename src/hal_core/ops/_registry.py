"""Per-backend registry of op implementations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._catalog import OPS
from ._coverage import OpCoverage
from ._spec import OpCall, OpImpl, Runner

if TYPE_CHECKING:
    from ..tuning import Knob

__all__ = ["OpRegistry"]


class OpRegistry:
    """The implementations one backend offers, per op, best first (ops: those of :data:`~hal_core.ops.OPS`)."""

    def __init__(self) -> None:
        self._impls: dict[str, tuple[OpImpl, ...]] = {}
        self._coverage: dict[str, OpCoverage] = {}
        #: Counts the changes (registrations, declarations): what a caller learnt from the registry stands while
        #: this number does.
        self.generation = 0

    def register(
        self,
        op: str | OpImpl,
        fn: Callable[[OpCall], Any] | None = None,
        *,
        priority: int = 0,
        supports: Callable[[OpCall], bool | str] | None = None,
        name: str = "",
        knobs: Sequence[Knob] = (),
        plan: Callable[[OpCall], Runner | None] | None = None,
    ) -> OpImpl:
        """Register an implementation; pass an :class:`OpImpl` or its fields (``knobs``: its tunables, ``plan``:
        its runners for repeated call signatures, see :class:`OpImpl`)."""
        if isinstance(op, OpImpl):
            impl = op
        else:
            if fn is None:
                raise TypeError("register(op, fn): fn is required")
            extra = {"supports": supports} if supports is not None else {}
            impl = OpImpl(op=op, fn=fn, priority=priority, name=name, knobs=tuple(knobs), plan=plan, **extra)
        _known(impl.op)
        names = [k.name for k in impl.knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"implementation {impl.name!r}: knob names must be distinct, got {names}")
        if not callable(impl.fn) or not callable(impl.supports) or not (impl.plan is None or callable(impl.plan)):
            raise TypeError(f"implementation {impl.name!r} of {impl.op}: fn, supports and plan must be callable")
        impls = sorted((*self._impls.get(impl.op, ()), impl), key=lambda i: -i.priority)
        self._impls[impl.op] = tuple(impls)
        self.generation += 1
        return impl

    def declare(self, op: str, coverage: OpCoverage) -> None:
        """Declare what this backend's own implementations of ``op`` handle (see :class:`OpCoverage`)."""
        spec = _known(op)
        if not isinstance(coverage, OpCoverage):
            raise TypeError(f"declare({op!r}, ...): expected an OpCoverage, got {type(coverage).__name__}")
        coverage.check_fields(spec)
        self._coverage[op] = coverage
        self.generation += 1

    def coverage(self, op: str) -> OpCoverage:
        """The declaration for ``op``; an op declared by nobody is claimed whole."""
        _known(op)
        return self._coverage.get(op, _CLAIMED)

    def implementations(self, op: str) -> tuple[OpImpl, ...]:
        """Implementations of ``op``, highest priority first."""
        return self._impls.get(op, ())

    def ops(self) -> list[str]:
        """The ops with at least one implementation."""
        return sorted(self._impls)


def _known(op: str) -> Any:
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"unknown op {op!r}; known: {sorted(OPS)}")
    return spec


#: What an op nobody declared gets: every valid call is claimed.
_CLAIMED = OpCoverage()
