"""One forward's plan for :class:`~hal_core.torch.transformers.HalPagedCache`: the mask read, the step's tensors.

Made once per forward, by the first layer's attention call, and shared by
every layer. The 2D attention mask is checked against the positions the
cache has seen: its prefix must be the mask the cached tokens were given,
its new columns left padding only. A host mask is read in place; a device
mask is compared on its device with the previous forward's (remembered
there), so only the new columns and one flag per row come to the host, in
one transfer — the one synchronisation a forward with a device mask makes.
The step's index tensors are views of the hal cache's arrays; an array the
cache hands out again (a decode step's packing, unchanged block tables)
keeps its tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .._errors import ArgumentError
from ..kvcache import StepInputs
from ._convert import to_tensor

__all__ = ["Plan", "Seen", "device_mask_read", "make_plan", "new_positions", "same_mask"]


class Plan(NamedTuple):
    """One forward's index tensors and hints, shared by every layer."""

    step: int
    rows: torch.Tensor | None  #: flat ``b * q_len + i`` of each real new token (None: every token is real)
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    #: The step's index arrays as the cache's own arrays (numpy on a host backend), for eager calls.
    native: dict[str, Any]


class Seen:
    """Which positions seen were real tokens, ``[batch, positions]``: grows by columns without copying what it holds
    (its storage doubles when full)."""

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self._store = np.zeros((0, 0), dtype=bool) if rows is None else np.array(rows, dtype=bool)
        self.array = self._store  # the positions seen (a view of the storage)

    def append(self, columns: np.ndarray) -> None:
        """Add a forward's new positions (``[batch, q_len]``; a first forward sets the batch)."""
        length = self.array.shape[1]
        end = length + columns.shape[1]
        if self._store.shape[0] != columns.shape[0] or end > self._store.shape[1]:
            store = np.zeros((columns.shape[0], max(end, 2 * self._store.shape[1], 64)), dtype=bool)
            if length:
                store[:, :length] = self.array
            self._store = store
        self._store[:, length:end] = columns
        self.array = self._store[:, :end]

    def keep(self, length: int) -> None:
        """Only the first ``length`` positions stay."""
        self.array = self._store[:, :length]


#: Mask dtypes numpy can view (the others are turned into booleans first).
_NUMPY_VIEWS = frozenset({torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32})
_INDEX_NAMES = ("slot_mapping", "query_start_loc", "block_tables", "seq_lens")


def make_plan(step_number: int, real: np.ndarray, all_real: bool, step: StepInputs, device: torch.device,
              previous: Plan | None) -> Plan:
    """The plan of a step whose new positions ``real`` (``[batch, q_len]``: real token or pad; ``all_real``: no
    pad) ``step`` packs."""
    native = {"slot_mapping": step.slot_mapping, "query_start_loc": step.query_start_loc,
              "block_tables": step.block_tables, "seq_lens": step.seq_lens}
    if previous is None:
        tensors = [to_tensor(native[name]) for name in _INDEX_NAMES]
    else:  # an array handed out again keeps its tensor
        tensors = [old if previous.native[name] is native[name] else to_tensor(native[name])
                   for name, old in zip(_INDEX_NAMES, previous[2:6], strict=True)]
    rows = None if all_real else torch.from_numpy(np.flatnonzero(real.reshape(-1))).to(device)
    slot_mapping, query_start_loc, block_tables, seq_lens = tensors
    return Plan(step_number, rows, slot_mapping, query_start_loc, block_tables, seq_lens, step.max_query_len,
                step.max_seq_len, native)


def new_positions(attention_mask: torch.Tensor | None, seen: np.ndarray, remembered: torch.Tensor | None,
                  batch: int, q_len: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """Which of a forward's ``q_len`` positions are real tokens, after checking the mask against the cache.

    ``seen`` (``[batch, past]``) says which positions the cache holds were
    real; ``remembered`` is the previous forward's device mask (None: none,
    or the cache changed since). Returns the new positions and the mask to
    remember for the next forward (None for a host mask).
    """
    past = seen.shape[1]
    if attention_mask is None:
        if not seen.all():
            raise ArgumentError(
                "HalPagedCache holds padded rows, but this forward has no attention_mask: pass the 2D mask of "
                f"the whole sequence ({past} positions held + {q_len} new), as generate() does")
        return np.ones((batch, q_len), dtype=bool), None
    if attention_mask.ndim != 2:
        raise ArgumentError(
            f"attn_implementation='hal' with a HalPagedCache takes the 2D padding mask [batch, length], got an "
            f"attention_mask of shape {tuple(attention_mask.shape)}; a custom 4D mask needs "
            f"attn_implementation='eager' or 'sdpa' (or 'hal' without a HalPagedCache, which runs torch SDPA)")
    if tuple(attention_mask.shape) != (batch, past + q_len):
        raise ArgumentError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, but the HalPagedCache holds {past} "
            f"positions and this forward adds {q_len}: pass the mask of the whole sequence, shape "
            f"({batch}, {past + q_len}) (to continue the cached text, give the whole text: generate() feeds "
            f"only the positions the cache lacks); for a new prompt call cache.reset() or use a new cache")
    mask = attention_mask.detach() if attention_mask.requires_grad else attention_mask
    keep = None
    if mask.is_cpu:  # read in place; a value other than 0 or 1 is compared as a boolean
        host = mask.numpy() if mask.dtype in _NUMPY_VIEWS else (mask != 0).numpy()
        real = host[:, past:]
        differs = None
        if past and not (host[:, :past] == seen).all():
            differs = ((host[:, :past] != 0) != seen).any(axis=1)
    else:
        keep = mask.clone() if mask.dtype == torch.bool else mask != 0  # the caller may write into its mask
        real, differs = device_mask_read(keep, seen, remembered)
    if differs is not None and differs.any():
        raise ArgumentError(
            f"attention_mask row {int(np.flatnonzero(differs)[0])} marks other positions as padding than the "
            f"HalPagedCache holds for its first {past} positions; pass the mask the cached tokens were given "
            f"(extended for the new ones)")
    real = np.array(real, dtype=bool)
    if not real.all():
        _check_left_padding(real, seen)
    return real, keep


def device_mask_read(mask: torch.Tensor, seen: np.ndarray, remembered: torch.Tensor | None,
                     ) -> tuple[np.ndarray, np.ndarray | None]:
    """A boolean mask's new columns on the host, and per row whether its prefix differs from the positions seen.

    With ``remembered`` (the previous forward's mask, of the prefix's shape) the prefix is compared where the
    mask lives and one transfer brings the new columns and a flag per row; without it the whole mask comes over.
    """
    past = seen.shape[1]
    if past and remembered is not None and tuple(remembered.shape) == seen.shape:
        flags = (mask[:, :past] != remembered).any(dim=1, keepdim=True)
        host = torch.cat([mask[:, past:], flags], dim=1).cpu().numpy()
        return host[:, :-1], host[:, -1]
    host = mask.cpu().numpy()
    return host[:, past:], (host[:, :past] != seen).any(axis=1) if past else None


def same_mask(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two 2D masks (or None: no padding) mark the same positions as real."""
    if a is None or b is None or a is b:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a != 0, b.to(a.device) != 0))


def _check_left_padding(real: np.ndarray, seen: np.ndarray) -> None:
    """Pads may only precede a sequence's first token: none after a real token, old or new."""
    q_len = real.shape[1]
    counts = real.sum(axis=1)
    bad = ~(real == (np.arange(q_len) >= (q_len - counts)[:, None])).all(axis=1)
    if seen.shape[1]:
        bad |= seen.any(axis=1) & (counts != q_len)
    if bad.any():
        raise ArgumentError(f"HalPagedCache supports left padding only: row {int(np.flatnonzero(bad)[0])} of the "
                            f"attention mask has a pad after a real token")
