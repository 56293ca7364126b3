"""Pieces the ops' input builders share: random values, paged block tables, poison in unused cache slots."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..arrays import numpy_dtype

__all__ = ["distinct_blocks", "poison_unused", "uniform"]


def uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values in [-0.5, 0.5) of hal dtype ``dtype``, drawn in float32 (fast: no float64 intermediate)."""
    values = rng.random(shape, dtype=np.float32)
    values -= 0.5
    return values.astype(numpy_dtype(dtype), copy=False)


def distinct_blocks(rng: np.random.Generator, lens: np.ndarray, block_size: int, spare_blocks: int, *,
                    garbage: bool) -> tuple[np.ndarray, int, np.ndarray]:
    """Block tables giving each sequence its own blocks in random order.

    Returns ``(block_tables int32 [num_seqs, max_blocks], num_blocks, used)`` where ``used[b, i]`` says
    whether slot ``i`` of block ``b`` holds a token of some sequence. With ``garbage`` the table has up to
    two spare columns and its entries past each sequence's last block hold -1, ``num_blocks + 5`` or another
    block (an op must never read them); without it they are 0.
    """
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    needed = -(-lens // block_size)
    max_blocks = int(needed.max(initial=0)) + (int(rng.integers(0, 3)) if garbage else 0)
    num_blocks = max(1, int(needed.sum()) + spare_blocks)
    order = rng.permutation(num_blocks)
    shape = (lens.size, max(1, max_blocks))
    if garbage:
        choices = np.stack([np.full(shape, -1), np.full(shape, num_blocks + 5), rng.integers(0, num_blocks, shape)])
        tables = np.take_along_axis(choices, rng.integers(0, 3, (1, *shape)), axis=0)[0].astype(np.int32)
    else:
        tables = np.zeros(shape, dtype=np.int32)
    used = np.zeros((num_blocks, block_size), dtype=bool)
    starts = np.concatenate([[0], np.cumsum(needed)])
    for s in range(lens.size):  # input construction, not a kernel
        blocks = order[starts[s]: starts[s + 1]]
        tables[s, : needed[s]] = blocks
        used.reshape(-1)[(blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[: lens[s]]] = True
    return tables, num_blocks, used


def poison_unused(caches: Iterable[np.ndarray], used: np.ndarray) -> None:
    """Write NaN into every cache slot ``used`` marks unused (caches ``[num_blocks, kv_heads, block, head]``)."""
    for cache in caches:
        cache.transpose(0, 2, 1, 3)[~used] = np.nan
