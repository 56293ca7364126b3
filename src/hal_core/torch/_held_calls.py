"""Held hal calls that :func:`~hal_core.torch.kernelize`'s replacements share: an op bound once and reused while
what it was bound for is unchanged, and the rotary table of a forward's ``cos``/``sin``."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import BoundOp
from ._host import HostRoute

__all__ = ["held_bound", "rotary_table"]


def held_bound(held: list[Any], route: HostRoute, op: str, key: tuple[Any, ...], **fixed: Any) -> BoundOp:
    """``op`` bound on ``route`` (:meth:`HostRoute.bind`) with ``fixed``, kept in ``held`` for the next call whose
    ``key`` (the route's backend and what identifies the fixed tensors) is the same."""
    key = (route.backend, *key)
    if held and len(held[0]) == len(key) and all(map(_same, held[0], key)):
        return held[1]
    bound = route.bind(op, **fixed)
    held[:] = [key, bound]
    return bound


def _same(held: Any, now: Any) -> bool:
    """Tensors and backends by identity, numbers, dtypes and shapes by value."""
    return held is now or (not isinstance(held, torch.Tensor) and type(held) is type(now) and held == now)


#: The last forward's ``(cos, sin, cos._version, batch, positions, table)``. The tensors themselves are held (one
#: forward's, bounded) and compared by identity: a freed tensor's address is reused by the next forward's.
_last_table: list[tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor]] = []


def rotary_table(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, cos_sin_cache)`` for ``batch * S`` token rows from a forward's ``cos``/``sin`` ``[B, S, D]``
    (``B`` is ``batch``, or 1 when every row has the same positions): one table row per ``cos`` row, built once
    per forward (every layer passes the same tensors)."""
    if _last_table:
        held_cos, held_sin, version, held_batch, positions, table = _last_table[0]
        if held_cos is cos and held_sin is sin and version == cos._version and held_batch == batch:
            return positions, table
    half = cos.shape[-1] // 2
    table = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).reshape(-1, 2 * half).float().contiguous()
    positions = torch.arange(batch * cos.shape[1], dtype=torch.int64, device=cos.device) % table.shape[0]
    _last_table[:] = [(cos, sin, cos._version, batch, positions, table)]
    return positions, table
