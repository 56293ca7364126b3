"""The arrays of the last step, kept so that a decode step (one new token per sequence) updates them.

A step that follows another over the same sequences, with nothing else
changed in between (the :class:`~hal_core.kvcache.BlockTable`'s version is
the one the last step left), and that adds exactly one token to each, needs
no rebuild: the lengths go up by one, each sequence's new slot is its last
block's next one, and a block table changes only where a sequence began a
block. Arrays handed out are never written afterwards: what changes is made
anew, what does not (the packing of a decode step, block tables without a
new block) is handed out again, device copies included.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._blocks import BlockTable

__all__ = ["LastStep", "decode_step"]


@dataclass
class LastStep:
    """The last step's sequences and arrays (host, and the device copies handed out)."""

    version: int  #: the block table's version right after the step
    seq_ids: tuple[Hashable, ...]
    lengths: np.ndarray  #: int32 [num_seqs], host
    longest: int  #: the largest of ``lengths`` (0 without sequences)
    tables: np.ndarray  #: int32 [num_seqs, width], host
    tables_device: Any
    max_blocks: int | None
    #: The packing of a decode step: ``(query_start_loc on the device, rows 0..num_seqs-1 on the host)``.
    decode_packing: tuple[Any, np.ndarray] | None = None


def decode_step(last: LastStep | None, blocks: BlockTable, new_tokens: Mapping[Hashable, int],
                max_blocks: int | None, device: Callable[[np.ndarray], Any]) -> tuple[LastStep, dict[str, Any]] | None:
    """The next :class:`LastStep` and the step's fields, or None when this is not a decode step after ``last``.

    A decode step: the same sequences in the same order, one new token each,
    the same ``max_blocks``, and no change to ``blocks`` since ``last``. The
    growth is all or nothing (:class:`~hal_core.OutOfBlocksError`, changing
    nothing); a table wider than ``max_blocks`` returns None (the general
    path raises).
    """
    if last is None or last.version != blocks.version or last.max_blocks != max_blocks:
        return None
    seq_ids = tuple(new_tokens)
    if seq_ids != last.seq_ids:
        return None
    for n in new_tokens.values():
        if n != 1 or type(n) is not int:
            return None
    longest = last.longest
    if max_blocks is not None and longest // blocks.block_size + 1 > max_blocks:
        return None
    slots, fresh = blocks.append_one(seq_ids)
    lengths = last.lengths + 1
    tables, tables_device = last.tables, last.tables_device
    if fresh:
        width = max(column for _, column, _ in fresh) + 1
        grow = width - tables.shape[1]  # only without max_blocks (checked above)
        tables = np.pad(tables, ((0, 0), (0, grow))) if grow > 0 else tables.copy()
        for row, column, block in fresh:
            tables[row, column] = block
        tables_device = device(tables)
    packing = last.decode_packing
    if packing is None:
        packing = (device(np.arange(len(seq_ids) + 1, dtype=np.int32)), np.arange(len(seq_ids), dtype=np.int64))
    state = LastStep(blocks.version, seq_ids, lengths, longest + 1, tables, tables_device, max_blocks, packing)
    fields = {
        "seq_ids": seq_ids, "slot_mapping": device(np.array(slots, dtype=np.int64)),
        "query_start_loc": packing[0], "block_tables": tables_device, "seq_lens": device(lengths),
        "max_query_len": 1, "max_seq_len": longest + 1,
        "positions": last.lengths.astype(np.int64), "row_seq": packing[1], "last_rows": packing[1],
    }
    return state, fields
