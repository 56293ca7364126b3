"""Block bookkeeping of a paged KV cache: free list, reference counts, sequences.

No arrays live here, so the rules can be tested on their own:

- a sequence of ``n`` tokens owns ``ceil(n / block_size)`` blocks, in order;
  token ``t`` sits in slot ``blocks[t // block_size] * block_size + t % block_size``;
- a fork shares the parent's *full* blocks (their reference count goes up)
  and gets a fresh block for a partial last one, whose content the caller
  copies (:class:`ForkCopy`); so a shared block is always full and nobody
  writes into it again;
- every operation that needs blocks is all-or-nothing: when too few are
  free it raises :class:`~hal_core.OutOfBlocksError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .._errors import OutOfBlocksError

__all__ = ["BlockTable", "BlockUsage", "ForkCopy"]


class ForkCopy(NamedTuple):
    """A block whose K/V content must be copied from ``src`` to ``dst`` after a fork."""

    src: int
    dst: int


@dataclass(frozen=True)
class BlockUsage:
    """How many blocks are in use, free, and shared between sequences."""

    total: int
    used: int
    free: int
    shared: int
    sequences: int
    tokens: int


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTable:
    """Which blocks each sequence owns; hands blocks out from a free list.

    Sequence ids are any hashable values. Blocks are numbered
    ``0 .. num_blocks - 1`` and handed out lowest first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # a stack; pops 0 first
        self._refs = [0] * self.num_blocks
        self._seqs: dict[Hashable, _Seq] = {}
        #: Goes up with every change of any sequence: a copy of the tables made at one version is current while
        #: the version stays the same.
        self.version = 0

    # -- queries ----------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def length(self, seq_id: Hashable) -> int:
        """Tokens held by ``seq_id``."""
        return self._get(seq_id).length

    def blocks(self, seq_id: Hashable) -> list[int]:
        """The blocks of ``seq_id``, in token order (a copy)."""
        return list(self._get(seq_id).blocks)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Fresh blocks needed to grow ``seq_id`` by ``num_tokens``."""
        seq = self._get(seq_id)
        return _ceil_div(seq.length + num_tokens, self.block_size) - len(seq.blocks)

    def can_grow(self, growth: Mapping[Hashable, int]) -> bool:
        """Whether :meth:`extend_many` with ``growth`` would succeed."""
        return sum(self.blocks_needed(s, n) for s, n in growth.items()) <= self.num_free

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Slot numbers (int64) of tokens ``start .. stop - 1`` of ``seq_id``."""
        seq = self._get(seq_id)
        stop = seq.length if stop is None else stop
        if not 0 <= start <= stop <= seq.length:
            raise IndexError(f"tokens {start}..{stop} out of range for sequence {seq_id!r} of length {seq.length}")
        t = np.arange(start, stop, dtype=np.int64)
        table = np.asarray(seq.blocks, dtype=np.int64)
        return table[t // self.block_size] * self.block_size + t % self.block_size if t.size else t

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self._free)
        shared = sum(1 for r in self._refs if r > 1)
        tokens = sum(s.length for s in self._seqs.values())
        return BlockUsage(self.num_blocks, used, len(self._free), shared, len(self._seqs), tokens)

    # -- changes ----------------------------------------------------------

    def add(self, seq_id: Hashable, num_tokens: int = 0) -> None:
        """Start sequence ``seq_id`` holding ``num_tokens`` tokens (blocks allocated for them)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or pick a new id")
        _check_count(num_tokens)
        needed = _ceil_div(num_tokens, self.block_size)
        self._reserve(needed)
        self._seqs[seq_id] = _Seq(self._take(needed), num_tokens)
        self.version += 1

    def extend(self, seq_id: Hashable, num_tokens: int) -> np.ndarray:
        """Grow ``seq_id`` by ``num_tokens``; return the new tokens' slots (int64)."""
        return self.extend_many({seq_id: num_tokens})[seq_id]

    def extend_many(self, growth: Mapping[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """Grow several sequences at once, all or nothing; return each one's new slots."""
        for seq_id, n in growth.items():
            self._get(seq_id)
            _check_count(n)
        self._reserve(sum(self.blocks_needed(s, n) for s, n in growth.items()))
        self.version += 1
        slots = {}
        for seq_id, n in growth.items():
            seq = self._seqs[seq_id]
            if n and seq.blocks and seq.length % self.block_size and self._refs[seq.blocks[-1]] > 1:
                raise AssertionError("a shared block is partial; fork must copy partial blocks")  # never
            seq.blocks += self._take(self.blocks_needed(seq_id, n))
            start = seq.length
            seq.length += n
            slots[seq_id] = self.slots(seq_id, start)
        return slots

    def append_one(self, seq_ids: Sequence[Hashable]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Grow each of the distinct ``seq_ids`` by one token, all or nothing (a decode step).

        Returns the new tokens' slots and, for each sequence that began a
        block, ``(index in seq_ids, index of the block in its table, block)``.
        """
        seqs = [self._get(s) for s in seq_ids]
        size = self.block_size
        self._reserve(sum(1 for seq in seqs if seq.length % size == 0))
        self.version += 1
        slots, fresh = [], []
        for row, seq in enumerate(seqs):
            offset = seq.length % size
            if offset == 0:
                (block,) = self._take(1)
                fresh.append((row, len(seq.blocks), block))
                seq.blocks.append(block)
            elif self._refs[seq.blocks[-1]] > 1:
                raise AssertionError("a shared block is partial; fork must copy partial blocks")  # never
            slots.append(seq.blocks[-1] * size + offset)
            seq.length += 1
        return slots, fresh

    def fork(self, parent: Hashable, child: Hashable) -> ForkCopy | None:
        """Start ``child`` as a copy of ``parent``, sharing its full blocks.

        Returns the copy the caller must make of a partial last block (or
        None when the parent's blocks are all full).
        """
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already exists; free it first or pick a new id")
        seq = self._get(parent)
        partial = seq.length % self.block_size != 0
        self._reserve(1 if partial else 0)
        self.version += 1
        shared = seq.blocks[:-1] if partial else list(seq.blocks)
        for block in shared:
            self._refs[block] += 1
        copy = None
        if partial:
            (fresh,) = self._take(1)
            copy = ForkCopy(seq.blocks[-1], fresh)
            shared.append(fresh)
        self._seqs[child] = _Seq(shared, seq.length)
        return copy

    def truncate_many(self, lengths: Mapping[Hashable, int]) -> list[ForkCopy]:
        """Shorten sequences to ``lengths`` tokens, all or nothing; blocks nobody holds any more are freed.

        A kept last block that becomes partial while another sequence shares it
        is replaced by a fresh block (so a shared block stays full): the
        returned copies say whose content the caller copies.
        """
        refs, free, needed = list(self._refs), len(self._free), 0  # a dry run, in the order of the real one
        for seq_id, n in lengths.items():
            seq = self._get(seq_id)
            _check_count(n)
            if n > seq.length:
                raise ValueError(f"cannot truncate sequence {seq_id!r} of {seq.length} tokens to {n}")
            keep = _ceil_div(n, self.block_size)
            for block in seq.blocks[keep:]:
                refs[block] -= 1
                free += refs[block] == 0
            if n % self.block_size and refs[seq.blocks[keep - 1]] > 1:
                needed, free = needed + 1, free - 1
                refs[seq.blocks[keep - 1]] -= 1
                if free < 0:
                    raise OutOfBlocksError(needed, needed + free)
        self.version += 1
        copies = []
        for seq_id, n in lengths.items():
            seq = self._seqs[seq_id]
            keep = _ceil_div(n, self.block_size)
            for block in reversed(seq.blocks[keep:]):
                self._release(block)
            del seq.blocks[keep:]
            seq.length = n
            if n % self.block_size and self._refs[seq.blocks[-1]] > 1:
                (fresh,) = self._take(1)
                copies.append(ForkCopy(seq.blocks[-1], fresh))
                self._release(seq.blocks[-1])
                seq.blocks[-1] = fresh
        return copies

    def free(self, seq_id: Hashable) -> None:
        """End ``seq_id``; blocks nobody else holds go back to the free list."""
        seq = self._seqs.pop(self._key(seq_id))
        self.version += 1
        for block in reversed(seq.blocks):
            self._release(block)

    # -- checks -----------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        counts = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            assert len(seq.blocks) == _ceil_div(seq.length, self.block_size), f"{seq_id!r}: block count"
            assert len(set(seq.blocks)) == len(seq.blocks), f"{seq_id!r}: a block twice in one sequence"
            for i, block in enumerate(seq.blocks):
                counts[block] += 1
                last_partial = i == len(seq.blocks) - 1 and seq.length % self.block_size
                assert not (last_partial and self._refs[block] > 1), f"{seq_id!r}: shared partial block {block}"
        assert counts == self._refs, "reference counts differ from ownership"
        free = set(self._free)
        assert len(free) == len(self._free), "a block twice on the free list"
        assert free == {b for b, r in enumerate(self._refs) if r == 0}, "free list differs from unowned blocks"

    # -- internals --------------------------------------------------------

    def _key(self, seq_id: Hashable) -> Hashable:
        self._get(seq_id)
        return seq_id

    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the KV cache") from None

    def _reserve(self, needed: int) -> None:
        if needed > len(self._free):
            raise OutOfBlocksError(needed, len(self._free))

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def _take(self, count: int) -> list[int]:
        taken = [self._free.pop() for _ in range(count)]
        for block in taken:
            self._refs[block] = 1
        return taken


def _check_count(num_tokens: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
