"""What every peer shares: the :class:`Peer` record, :class:`PeerUnavailable`, and torch brought in only on demand.

torch is imported here only when a peer is built; without it the peer is reported ``missing``, never fatal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ._cases import Case

__all__ = ["Peer", "PeerUnavailable", "Runner", "inference", "rotating", "to_torch", "torch_module"]


class PeerUnavailable(Exception):
    """The peer cannot run here (its library is not installed, or it does not apply); the message says why."""


Runner = Callable[[int], object]


@dataclass(frozen=True)
class Peer:
    """A named peer: ``applies(case, host)`` and ``build(inputs, xp)`` -> a function of the call number."""

    name: str
    applies: Callable[[Case, bool], bool]
    build: Callable[[Sequence[dict[str, Any]], Any], Runner]


def torch_module() -> Any:
    """torch, or :class:`PeerUnavailable` saying it is not installed."""
    try:
        import torch
    except ImportError as exc:
        raise PeerUnavailable(f"torch is not installed ({exc}); pip install torch") from None
    return torch


def rotating(calls: Sequence[Callable[[], object]]) -> Runner:
    """A runner that makes call ``i`` on input set ``i`` modulo their count."""
    return lambda i: calls[i % len(calls)]()


def inference(torch: Any, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run under ``torch.inference_mode()``."""
    def run() -> object:
        with torch.inference_mode():
            return fn()

    return run


def to_torch(torch: Any, array: np.ndarray) -> Any:
    """A tensor over ``array``'s memory (bf16 through its bits)."""
    if array.dtype == numpy_dtype("bf16"):
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)
