"""What a front door records: each call that did not run where it was sent, and per-op statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._spec import OpCall

__all__ = ["DispatchEvent", "OpStats"]


@dataclass(frozen=True)
class DispatchEvent:
    """A call that did not run where it was sent: ``kind`` is ``'fallback'`` or ``'fault'``.

    A ``'fault'`` is an implementation that raised or returned a bad result
    (the call then fell back, or raised under ``HAL_STRICT=1``).
    """

    kind: str
    backend: str
    op: str
    reason: str
    call: OpCall


@dataclass
class OpStats:
    """What one backend's front door did for one op (see :func:`hal_core.stats`)."""

    calls: int = 0
    #: Implementation name → calls it answered (``'reference'`` for the float64 path).
    implementations: dict[str, int] = field(default_factory=dict)
    #: Reason → calls that fell back for it.
    fallbacks: dict[str, int] = field(default_factory=dict)
    #: Seconds spent on the fallback path (copies included).
    fallback_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "implementations": dict(self.implementations),
                "fallbacks": dict(self.fallbacks), "fallback_seconds": self.fallback_seconds}
