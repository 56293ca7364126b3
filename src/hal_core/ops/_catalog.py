"""The catalogue of ops: every :class:`~hal_core.ops.OpSpec` hal knows, by name.

hal's own ops register themselves when :mod:`hal_core.ops` is imported; an op defined elsewhere
becomes known with :func:`register_op` (and leaves with :func:`unregister_op`). Everything that
loops over the ops (the front door, coverage, tuning, ``hal bench``, ``hal info --explain``, the torch
operators) reads this table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._spec import OpSpec

__all__ = ["OPS", "register_op", "unregister_op"]

#: Every op hal knows, by name.
OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    """Make ``spec`` known by its name (idempotent for the same class); returns it.

    Raises ``ValueError`` when another op class already holds the name.
    """
    from ._spec import OpSpec

    if not isinstance(spec, OpSpec):
        raise TypeError(f"register_op: expected an OpSpec instance, got {type(spec).__name__}")
    held = OPS.get(spec.name)
    if held is not None and type(held) is not type(spec):
        raise ValueError(f"register_op: op {spec.name!r} is already defined by {type(held).__qualname__}")
    OPS[spec.name] = spec
    return spec


def unregister_op(name: str) -> None:
    """Forget the op ``name`` (an op defined outside hal, e.g. in a test)."""
    if OPS.pop(name, None) is None:
        raise KeyError(f"unregister_op: no op named {name!r}")
