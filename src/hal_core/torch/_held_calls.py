"""Held hal calls that :func:`~hal_core.torch.kernelize`'s replacements share: an op bound once and reused while
what it was bound for is unchanged, and the rotary table of a forward's ``cos``/``sin``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..interop import host_view
from ..ops import BoundOp
from ._host import HostRoute

__all__ = ["held_bound", "rotary_arrays", "rotary_table", "version_of"]


def held_bound(held: list[Any], route: HostRoute, op: str, key: tuple[Any, ...], **fixed: Any) -> BoundOp:
    """``op`` bound on ``route`` (:meth:`HostRoute.bind`) with ``fixed``, kept in ``held`` for the next call whose
    ``key`` (the route's backend and what identifies the fixed tensors) is the same."""
    key = (route.backend, *key)
    if held and len(held[0]) == len(key) and all(map(_same, held[0], key)):
        return held[1]
    bound = route.bind(op, **fixed)
    held[:] = [key, bound]
    return bound


def version_of(tensor: torch.Tensor) -> int | None:
    """``tensor._version`` (its in-place writes so far), or None for an inference tensor (one made under
    ``torch.inference_mode``: torch keeps no version counter for it, and reading one raises)."""
    return None if tensor.is_inference() else tensor._version


def _same(held: Any, now: Any) -> bool:
    """Tensors and backends by identity, numbers, dtypes and shapes by value."""
    return held is now or (not isinstance(held, torch.Tensor) and type(held) is type(now) and held == now)


#: The last forward's ``(cos, sin, its version, batch, positions, table)``. The tensors themselves are held (one
#: forward's, bounded) and compared by identity: a freed tensor's address is reused by the next forward's. An
#: inference tensor has no version (:func:`version_of`): it is held by identity alone (a model's forward makes its
#: ``cos``/``sin`` anew and writes them nowhere).
_last_table: list[tuple[torch.Tensor, torch.Tensor, int | None, int, torch.Tensor, torch.Tensor]] = []


def rotary_table(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, cos_sin_cache)`` for ``batch * S`` token rows from a forward's ``cos``/``sin`` ``[B, S, D]``
    (``B`` is ``batch``, or 1 when every row has the same positions): one table row per ``cos`` row, built once
    per forward (every layer passes the same tensors)."""
    if _last_table:
        held_cos, held_sin, version, held_batch, positions, table = _last_table[0]
        if held_cos is cos and held_sin is sin and version == version_of(cos) and held_batch == batch:
            return positions, table
    half = cos.shape[-1] // 2
    table = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).reshape(-1, 2 * half).float().contiguous()
    positions = torch.arange(batch * cos.shape[1], dtype=torch.int64, device=cos.device) % table.shape[0]
    _last_table[:] = [(cos, sin, version_of(cos), batch, positions, table)]
    return positions, table


#: The numpy views of the last table :func:`rotary_arrays` gave: ``(positions, table, their views)``.
_last_arrays: list[tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray]]] = []


def rotary_arrays(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rotary_table` as numpy views (made once per table: every layer of a forward asks for the same)."""
    positions, table = rotary_table(cos, sin, batch)
    if _last_arrays and _last_arrays[0][0] is positions and _last_arrays[0][1] is table:
        return _last_arrays[0][2]
    arrays = (host_view(positions, "positions"), host_view(table, "cos_sin_cache"))
    _last_arrays[:] = [(positions, table, arrays)]
    return arrays
