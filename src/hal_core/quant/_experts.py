"""``ExpertWeights``: the quantized weights of a mixture-of-experts layer, one :class:`QuantizedWeight` per expert.

Each expert ``e`` has

- ``w13[e]``: the joined gate and up projections ``[hidden, 2 * intermediate]`` (columns
  ``0 .. intermediate - 1`` the gate's, the rest the up's), and
- ``w2[e]``: the down projection ``[intermediate, hidden]``,

in hal's group-wise format (docs/quantization.md). Every expert has the same shapes, bits and group
size (checked when the value is made, naming the expert); scales, zero points and act-order may differ
per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._quantize import quantize
from ._weight import QuantizedWeight

__all__ = ["ExpertWeights", "quantize_experts"]


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """Per-expert quantized ``w13`` (gate|up ``[hidden, 2 * intermediate]``) and ``w2`` (down ``[intermediate,
    hidden]``) weights; :attr:`shape` is ``(num_experts, hidden, intermediate)``."""

    w13: tuple[QuantizedWeight, ...]
    w2: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        w13, w2 = tuple(self.w13), tuple(self.w2)
        object.__setattr__(self, "w13", w13)
        object.__setattr__(self, "w2", w2)
        if not w13:
            raise ValueError("ExpertWeights: expected at least one expert, got an empty w13")
        if len(w2) != len(w13):
            raise ValueError(f"ExpertWeights: w13 has {len(w13)} experts but w2 has {len(w2)}")
        for field, weights in (("w13", w13), ("w2", w2)):
            for e, weight in enumerate(weights):
                if not isinstance(weight, QuantizedWeight):
                    raise TypeError(f"ExpertWeights: {field}[{e}] must be a hal_core.quant.QuantizedWeight, "
                                    f"got {type(weight).__name__}")
        first13, first2 = w13[0], w2[0]
        hidden, joined = first13.shape
        if joined % 2:
            raise ValueError(f"ExpertWeights: w13[0] must be [hidden, 2 * intermediate], got shape {first13.shape} "
                             f"(an odd number of columns)")
        inter = joined // 2
        if first2.shape != (inter, hidden):
            raise ValueError(f"ExpertWeights: w2[0] must have shape {(inter, hidden)} ([intermediate, hidden] of "
                             f"w13[0]'s {first13.shape}), got {first2.shape}")
        if (first2.bits, first2.group_size) != (first13.bits, first13.group_size):
            raise ValueError(f"ExpertWeights: w2[0] has bits={first2.bits}, group_size={first2.group_size}; expected "
                             f"w13[0]'s bits={first13.bits}, group_size={first13.group_size}")
        for field, weights, first in (("w13", w13, first13), ("w2", w2, first2)):
            for e, weight in enumerate(weights[1:], start=1):
                for what in ("shape", "bits", "group_size"):
                    if getattr(weight, what) != getattr(first, what):
                        raise ValueError(f"ExpertWeights: {field}[{e}] has {what} {getattr(weight, what)}, "
                                         f"expected {getattr(first, what)} (expert 0's)")

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_experts, hidden, intermediate)``."""
        hidden, joined = self.w13[0].shape
        return (len(self.w13), hidden, joined // 2)

    @property
    def bits(self) -> int:
        return self.w13[0].bits

    @property
    def group_size(self) -> int:
        return self.w13[0].group_size

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's arrays."""
        return sum(w.nbytes for w in (*self.w13, *self.w2))

    def expert_nbytes(self, e: int) -> int:
        """Bytes of expert ``e``'s arrays (its ``w13`` and ``w2``)."""
        return self.w13[e].nbytes + self.w2[e].nbytes

    def weights(self) -> dict[str, QuantizedWeight]:
        """Every expert's weights by name: ``'w13[0]'``, ..., ``'w2[0]'``, ..."""
        named = {f"w13[{e}]": w for e, w in enumerate(self.w13)}
        named.update({f"w2[{e}]": w for e, w in enumerate(self.w2)})
        return named

    def arrays(self) -> dict[str, Any]:
        """Every array by name (``'w13[3].scales'``; None fields omitted)."""
        return {f"{name}.{field}": array for name, weight in self.weights().items()
                for field, array in weight.arrays().items()}

    def map_arrays(self, fn: Callable[[Any], Any]) -> ExpertWeights:
        """A copy with ``fn`` applied to every array of every expert (e.g. to move them to a device)."""
        return ExpertWeights(tuple(w.map_arrays(fn) for w in self.w13), tuple(w.map_arrays(fn) for w in self.w2))

    def __repr__(self) -> str:
        e, hidden, inter = self.shape
        return (f"ExpertWeights({e} experts, int{self.bits}, hidden={hidden}, intermediate={inter}, "
                f"group_size={self.group_size})")

    __hash__ = None  # type: ignore[assignment]


def quantize_experts(gate_up_weights: Sequence[Any] | np.ndarray, down_weights: Sequence[Any] | np.ndarray, *,
                     bits: int = 4, group_size: int = 128, symmetric: bool = True) -> ExpertWeights:
    """Quantise float experts: ``gate_up_weights[e]`` ``[hidden, 2 * intermediate]`` (gate columns first) and
    ``down_weights[e]`` ``[intermediate, hidden]`` (a ``[E, ...]`` array or a sequence of 2-D arrays), each
    with :func:`~hal_core.quant.quantize` (group-wise along its first dimension)."""
    if len(gate_up_weights) != len(down_weights):
        raise ValueError(f"quantize_experts: {len(gate_up_weights)} gate_up_weights but {len(down_weights)} "
                         f"down_weights")
    w13 = tuple(quantize(w, bits=bits, group_size=group_size, symmetric=symmetric) for w in gate_up_weights)
    w2 = tuple(quantize(w, bits=bits, group_size=group_size, symmetric=symmetric) for w in down_weights)
    return ExpertWeights(w13, w2)
