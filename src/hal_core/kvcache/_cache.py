"""The paged key and value caches of every layer on one device, and a step's index arrays."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..arrays import numpy_dtype
from ._blocks import BlockTable, ForkCopy, _ceil_div, _check_count
from ._step import LastStep, decode_step

if TYPE_CHECKING:
    from .._backend import Backend
    from .._memory import DeviceBuffer

__all__ = ["CacheConfig", "KVCacheUsage", "PagedKVCache", "StepInputs"]


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the cache: ``num_layers`` pairs of ``[num_blocks, num_kv_heads, block_size, head_size]``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    dtype: str = "fp16"  #: hal dtype name: 'fp32', 'fp16' or 'bf16'

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"CacheConfig.dtype must be 'fp32', 'fp16' or 'bf16', got {self.dtype!r}")

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of the caches (bf16 as ml_dtypes' bfloat16)."""
        return numpy_dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one cache (K or V of one layer)."""
        return self.num_kv_heads * self.block_size * self.head_size * self.np_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs over all layers, keys and values."""
        return 2 * self.num_layers * self.block_bytes


@dataclass(frozen=True)
class KVCacheUsage:
    """Blocks and bytes of a :class:`PagedKVCache` at one moment."""

    total_blocks: int
    used_blocks: int
    free_blocks: int
    shared_blocks: int
    sequences: int
    tokens: int
    bytes_allocated: int  #: device bytes held by the caches (rounded to the allocator's granularity)
    bytes_used: int  #: bytes of the blocks in use


@dataclass(frozen=True)
class StepInputs:
    """The index arrays of one step on the cache's device: the packed new tokens of every sequence.

    The step's new tokens are packed sequence by sequence, in ``seq_ids`` order: token row ``i`` is a new
    token of sequence ``seq_ids[row_seq[i]]`` at position ``positions[i]``, and ``slot_mapping[i]`` is
    where :func:`write_kv_cache` puts its key and value. Sequence ``s`` owns rows
    ``query_start_loc[s]:query_start_loc[s + 1]``; ``block_tables[s]`` and ``seq_lens[s]`` (its length,
    the new tokens included) are what :func:`paged_attention` reads, with ``max_query_len`` and
    ``max_seq_len`` as its host hints — :meth:`attention_args` gives them all. A pure decode step has one
    row per sequence.
    """

    seq_ids: tuple[Hashable, ...]
    slot_mapping: Any  #: int64 [num_tokens], device
    query_start_loc: Any  #: int32 [num_seqs + 1], device
    block_tables: Any  #: int32 [num_seqs, max_blocks], device
    seq_lens: Any  #: int32 [num_seqs], device
    max_query_len: int  #: the most new tokens of one sequence (at least 1)
    max_seq_len: int  #: the longest sequence (at least 1)
    positions: np.ndarray  #: int64 [num_tokens], host
    row_seq: np.ndarray  #: int64 [num_tokens], host: the index into ``seq_ids`` of each row
    last_rows: np.ndarray  #: int64 [len(seq_ids)], host: each sequence's last new row (-1 if none)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def attention_args(self) -> dict[str, Any]:
        """The keyword arguments of ``paged_attention`` this step gives (tables, lengths, packing, hints)."""
        return {"block_tables": self.block_tables, "seq_lens": self.seq_lens, "query_start_loc": self.query_start_loc,
                "max_query_len": self.max_query_len, "max_seq_len": self.max_seq_len}


class PagedKVCache:
    """Key and value caches of ``config.num_layers`` layers on one device, in blocks.

    Size it with ``num_blocks`` or with ``gpu_memory_utilization``, the
    fraction of the device's free memory (total memory when free is not
    known) the caches may take. Memory comes from the device's
    :class:`~hal_core.Allocator`, one buffer per cache; :meth:`close` (or
    leaving a ``with`` block) gives it back.
    """

    def __init__(
        self,
        backend: Backend,
        config: CacheConfig,
        *,
        num_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        device: int = 0,
    ) -> None:
        if (num_blocks is None) == (gpu_memory_utilization is None):
            raise ValueError("give exactly one of num_blocks and gpu_memory_utilization")
        self.backend = backend
        self.config = config
        self.device_index = device
        handle = backend.device(device)
        allocator = handle.allocator
        if num_blocks is None:
            num_blocks = self.blocks_for_memory(
                config, handle.capabilities.memory_free, handle.capabilities.memory_total,
                gpu_memory_utilization, allocator.granularity,  # type: ignore[arg-type]
            )
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.blocks = BlockTable(num_blocks, config.block_size)
        self._last: LastStep | None = None  # the last step's arrays, which a decode step updates
        shape = (num_blocks, config.num_kv_heads, config.block_size, config.head_size)
        dtype = config.np_dtype
        nbytes = num_blocks * config.block_bytes
        self._buffers: list[DeviceBuffer] = []
        self.key_caches: list[Any] = []
        self.value_caches: list[Any] = []
        try:
            for _ in range(config.num_layers):
                for caches in (self.key_caches, self.value_caches):
                    buffer = allocator.allocate(allocator.round_up(nbytes))
                    self._buffers.append(buffer)
                    array = buffer.as_array(shape, dtype)
                    array[...] = 0
                    caches.append(array)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def blocks_for_memory(
        config: CacheConfig, memory_free: int | None, memory_total: int, fraction: float, granularity: int
    ) -> int:
        """How many blocks fit in ``fraction`` of free (else total) memory, each cache rounded to ``granularity``."""
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        budget = int((memory_total if memory_free is None else memory_free) * fraction)
        per_cache = budget // (2 * config.num_layers) // granularity * granularity
        return per_cache // config.block_bytes

    # -- properties ---------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def layer(self, index: int) -> tuple[Any, Any]:
        """``(key_cache, value_cache)`` of layer ``index``."""
        return self.key_caches[index], self.value_caches[index]

    def usage(self) -> KVCacheUsage:
        b = self.blocks.usage()
        return KVCacheUsage(
            total_blocks=b.total, used_blocks=b.used, free_blocks=b.free, shared_blocks=b.shared,
            sequences=b.sequences, tokens=b.tokens,
            bytes_allocated=sum(buf.nbytes for buf in self._buffers),
            bytes_used=b.used * self.config.bytes_per_block,
        )

    # -- sequences ------------------------------------------------------------

    def add(self, seq_id: Hashable, num_tokens: int = 0) -> None:
        """Start a sequence with room for ``num_tokens`` tokens (usually 0: tokens come with steps)."""
        self.blocks.add(seq_id, num_tokens)

    def extend(self, seq_id: Hashable, num_tokens: int) -> np.ndarray:
        """Grow a sequence; return the new tokens' slots (host int64)."""
        return self.blocks.extend(seq_id, num_tokens)

    def fork(self, parent: Hashable, child: Hashable) -> ForkCopy | None:
        """Start ``child`` sharing ``parent``'s full blocks; its partial last block is copied on the device."""
        copy = self.blocks.fork(parent, child)
        if copy is not None:
            for caches in (self.key_caches, self.value_caches):
                for cache in caches:
                    cache[copy.dst] = cache[copy.src]
        return copy

    def truncate_many(self, lengths: Mapping[Hashable, int]) -> None:
        """Shorten sequences to ``lengths`` tokens, all or nothing (a shared block that would turn partial is
        copied first, on the device)."""
        for copy in self.blocks.truncate_many(lengths):
            for caches in (self.key_caches, self.value_caches):
                for cache in caches:
                    cache[copy.dst] = cache[copy.src]

    def free(self, seq_id: Hashable) -> None:
        """End a sequence; its unshared blocks return to the free list."""
        self.blocks.free(seq_id)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.blocks

    # -- step inputs ----------------------------------------------------------

    def prepare_step(self, new_tokens: Mapping[Hashable, int], *, max_blocks: int | None = None) -> StepInputs:
        """Grow each sequence by its count of new tokens (all or nothing) and build the step's arrays.

        Raises :class:`~hal_core.OutOfBlocksError` with every sequence unchanged
        when the blocks do not suffice. ``max_blocks`` pads the block tables
        to a fixed width (default: the longest table in the step); a step
        that would need wider tables raises ValueError, also changing nothing.

        A decode step (one new token for each of the last step's sequences,
        nothing else changed since) updates the last step's arrays instead of
        rebuilding them, and hands out again the device arrays that did not
        change (a decode step's ``query_start_loc``, block tables without a new
        block): the arrays of a step are read by the ops, never written.
        """
        decode = decode_step(self._last, self.blocks, new_tokens, max_blocks, self._device)
        if decode is not None:
            self._last, fields = decode
            return StepInputs(**fields)
        if max_blocks is not None:  # checked before growing anything
            for seq_id, n in new_tokens.items():
                _check_count(n)
                width = _ceil_div(self.blocks.length(seq_id) + int(n), self.block_size)
                _check_width(max_blocks, width)
        slots = self.blocks.extend_many(new_tokens)
        seq_ids = tuple(new_tokens)
        lengths = [self.blocks.length(s) for s in seq_ids]
        counts = [int(new_tokens[s]) for s in seq_ids]
        row_seq = np.repeat(np.arange(len(seq_ids), dtype=np.int64), counts)
        positions = np.concatenate(
            [np.arange(n - c, n, dtype=np.int64) for n, c in zip(lengths, counts, strict=True)]
        ) if seq_ids else np.zeros(0, np.int64)
        tables = self._table_rows(seq_ids, max_blocks)
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)
        last_rows = np.where(np.asarray(counts) > 0, starts[1:] - 1, -1).astype(np.int64)
        mapping = np.concatenate([slots[s] for s in seq_ids]) if seq_ids else np.zeros(0, np.int64)
        seq_lens = np.asarray(lengths, dtype=np.int32)
        block_tables = self._device(tables)
        self._last = LastStep(self.blocks.version, seq_ids, seq_lens, max(lengths, default=0), tables, block_tables,
                              max_blocks)
        return StepInputs(
            seq_ids=seq_ids,
            slot_mapping=self._device(mapping.astype(np.int64)),
            query_start_loc=self._device(starts),
            block_tables=block_tables,
            seq_lens=self._device(seq_lens),
            max_query_len=max(counts, default=0) or 1,
            max_seq_len=max(lengths, default=0) or 1,
            positions=positions,
            row_seq=row_seq,
            last_rows=last_rows,
        )

    def block_tables(self, seq_ids: Sequence[Hashable], *, max_blocks: int | None = None) -> Any:
        """int32 ``[len(seq_ids), max_blocks]`` block tables on the device (unused entries 0)."""
        return self._device(self._table_rows(tuple(seq_ids), max_blocks))

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> Any:
        """int32 ``[len(seq_ids)]`` lengths on the device."""
        return self._device(np.asarray([self.blocks.length(s) for s in seq_ids], dtype=np.int32))

    def slot_mapping(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> Any:
        """int64 slots of tokens ``start .. stop - 1`` of one sequence, on the device."""
        return self._device(self.blocks.slots(seq_id, start, stop))

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Give the caches' memory back to the allocator; the cache is unusable afterwards."""
        self.key_caches, self.value_caches = [], []
        self._last = None
        for buffer in self._buffers:
            buffer.free()
        self._buffers = []

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        u = self.usage()
        c = self.config
        return (f"<PagedKVCache {c.num_layers} layers x {c.num_kv_heads} kv heads x {c.head_size} {c.dtype}, "
                f"{u.used_blocks}/{u.total_blocks} blocks of {c.block_size} used, {len(self.blocks)} sequences>")

    # -- internals --------------------------------------------------------------

    def _table_rows(self, seq_ids: tuple[Hashable, ...], max_blocks: int | None) -> np.ndarray:
        tables = [self.blocks.blocks(s) for s in seq_ids]
        width = max((len(t) for t in tables), default=0)
        if max_blocks is not None:
            _check_width(max_blocks, width)
            width = max_blocks
        rows = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
        for i, table in enumerate(tables):
            rows[i, : len(table)] = table
        return rows

    def _device(self, array: np.ndarray) -> Any:
        return self.backend.asarray(array, self.device_index)


def _check_width(max_blocks: int, width: int) -> None:
    if max_blocks < width:
        raise ValueError(f"max_blocks={max_blocks} is below the longest block table ({width} blocks)")
