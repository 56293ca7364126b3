"""The numpy fallback of ``paged_attention``, used only where the compiled kernels failed to load.

Gather, masked softmax and matmul in float32, all vectorised; several times
slower than the compiled kernel (it copies every used block into padded
float32 workspaces), and a non-finite used key or value is not turned into
NaN the way the float64 reference does.

Decode batches without a window, softcap, sinks or ALiBi (no option of
:class:`~hal_core.ops.AttentionOptions` but the scale) take the batched
path below; any other call (prompts, prompt chunks, those options) runs
:func:`_attend_varlen`, one sequence at a time in chunks of
:data:`VARLEN_CHUNK_ROWS` query tokens.

Sequences are sorted by length and grouped in chunks whose padded K/V
(storage copy plus float32 copy) fit :data:`CHUNK_BUDGET_BYTES`; each
chunk's tokens are split in partitions of at most :data:`PARTITION_TOKENS`.
Every (chunk, partition) runs as one task on a thread per core and yields
its softmax max, denominator and unnormalised ``P @ V``; a reduce step
merges the partitions (vLLM's v2 idea), so memory stays bounded and long
contexts use every core. Python loops run only over chunks and partitions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hal_core.ops import AttentionOptions
from hal_core.ops.paged_attention_options import ATTENTION_OPTIONS

from ._common import parallel_for, widen, workspace

__all__ = ["CHUNK_BUDGET_BYTES", "PARTITION_TOKENS", "VARLEN_CHUNK_ROWS", "attend", "layer_options", "to_float32"]

#: Bytes of gathered K/V (and scores) one chunk may hold; small enough to stay cache-warm.
CHUNK_BUDGET_BYTES = 8 * 1024 * 1024
#: Tokens per partition: one task each, merged by the reduce step.
PARTITION_TOKENS = 1024
#: Variable-length path: query tokens of one sequence scored at once (bounds the [heads, rows, keys] scores).
VARLEN_CHUNK_ROWS = 256


def layer_options(options: AttentionOptions | float, flat: dict[str, Any]) -> AttentionOptions:
    """``options`` itself, or an :class:`~hal_core.ops.AttentionOptions` of a scale and the other options given as
    keywords (``flat``); a TypeError when both a value and keywords are given."""
    if not isinstance(options, AttentionOptions):
        return AttentionOptions(scale=options, **flat)
    if flat:
        raise TypeError(f"options given as AttentionOptions and as keywords {sorted(flat)}")
    return options


def to_float32(array: np.ndarray) -> np.ndarray:
    """``array`` as float32 (``array`` itself when it already is); fp16/bf16 widen exactly by bit arithmetic."""
    if array.dtype == np.float32:
        return array
    return widen(np.ascontiguousarray(array), np.empty(array.shape, dtype=np.float32))


def attend(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    options: AttentionOptions | float,
    *,
    query_start_loc: np.ndarray | None = None,
    budget: int | None = None,
    partition_tokens: int | None = None,
    **flat_options: Any,
) -> np.ndarray:
    """Paged attention of validated numpy inputs (hal-core's contract), as float32 ``[tokens, heads, head_size]``;
    ``options`` as for :func:`hal_cpu.ops.paged_attention.attend` (the layer's options, or a scale with the
    others as keywords)."""
    options = layer_options(options, flat_options)
    scale = options.scale
    if query_start_loc is not None or ATTENTION_OPTIONS.used_variants(ATTENTION_OPTIONS.flat(options)):
        return _attend_varlen(query, key_cache, value_cache, block_tables, seq_lens, options, query_start_loc)
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    partition_tokens = PARTITION_TOKENS if partition_tokens is None else partition_tokens
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, head_size), dtype=np.float32)
    lens = seq_lens.astype(np.int64)
    order = np.argsort(lens, kind="stable")
    order = order[lens[order] > 0]  # empty sequences stay zero
    if order.size == 0:
        return out
    # [S, kv_heads, head_size, group]: the scores come out of one contiguous matmul per (seq, kv head)
    q_t = np.ascontiguousarray(
        (to_float32(query) * np.float32(scale)).reshape(num_seqs, num_kv_heads, group, head_size).swapaxes(-1, -2)
    )
    part_blocks = max(1, partition_tokens // block_size)
    per_token = num_kv_heads * head_size * (key_cache.dtype.itemsize + 4) + 2 * 4 * num_heads
    sorted_lens = lens[order]
    tasks: list[tuple[np.ndarray, int, int]] = []  # (sequences, first block, end block)
    start = 0
    while start < order.size:  # chunks of similar-length sequences within the budget
        padded = np.minimum(-(-sorted_lens[start:] // block_size), part_blocks) * block_size
        cost = np.arange(1, padded.size + 1) * padded * per_token  # non-decreasing
        rows = max(1, int(np.searchsorted(cost, budget, side="right")))
        idx = order[start:start + rows]
        used_blocks = int(-(-sorted_lens[start + idx.size - 1] // block_size))
        tasks.extend((idx, b0, min(used_blocks, b0 + part_blocks)) for b0 in range(0, used_blocks, part_blocks))
        start += rows
    partials: list[Any] = [None] * len(tasks)  # filled by the tasks

    def run(task: int) -> None:
        idx, b0, b1 = tasks[task]
        partials[task] = _partition(q_t[idx], key_cache, value_cache, block_tables[idx], lens[idx], b0, b1)

    parallel_for(run, range(len(tasks)))  # chunks and partitions of long sequences run in parallel
    first = 0
    while first < len(tasks):  # merge each chunk's partitions (vLLM v2's reduce step)
        last = first
        while last + 1 < len(tasks) and tasks[last + 1][0] is tasks[first][0]:
            last += 1
        idx = tasks[first][0]
        out[idx] = _merge(partials[first:last + 1]).reshape(idx.size, num_heads, head_size)
        first = last + 1
    return out


def _merge(partials: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Combine per-partition ``(max, denominator, accumulator)`` into normalised outputs."""
    top = partials[0][0]
    for part_max, _, _ in partials[1:]:
        top = np.maximum(top, part_max)
    safe_top = np.where(np.isfinite(top), top, np.float32(0))
    denom = np.zeros_like(top)
    acc = np.zeros_like(partials[0][2])
    for part_max, part_denom, part_acc in partials:
        weight = np.exp(part_max - safe_top)  # [C, kv_heads, 1, group]; 0 for empty partitions
        denom += part_denom * weight
        acc += part_acc * weight.swapaxes(-1, -2)
    denom = denom.swapaxes(-1, -2)
    result = np.divide(acc, denom, out=np.zeros_like(acc), where=denom > 0)
    # a NaN or infinite maximum (NaN in q or a used key, +-inf scores) makes the reference's softmax NaN
    result[np.broadcast_to(~np.isfinite(top).swapaxes(-1, -2), result.shape)] = np.nan
    return result


def _gather(cache: np.ndarray, blocks: np.ndarray, invalid: np.ndarray) -> np.ndarray:
    """Blocks ``[C, nb]`` of ``cache`` as float32 ``[C, kv_heads, nb * block_size, head_size]`` (a workspace).

    Rows of tokens marked in ``invalid`` ``[C, nb, block_size]`` (past a
    sequence's length, or in blocks it does not use) come out as zeros, so
    whatever the cache holds there (NaN, Inf) never reaches a result.
    """
    chunk, nb = blocks.shape
    _, num_kv_heads, block_size, head_size = cache.shape
    picked = workspace("picked", (chunk, nb, num_kv_heads, block_size, head_size), cache.dtype)
    np.take(cache, blocks, axis=0, out=picked, mode="clip")  # one contiguous copy per block
    ragged = np.flatnonzero(invalid.any(axis=(0, 2)))  # blocks holding any invalid row
    if ragged.size:  # zero the storage bits (0 is +0.0 in every float format), only from the first such block
        first = int(ragged[0])
        bits = picked.view(np.dtype(f"u{cache.dtype.itemsize}"))[:, first:]
        np.copyto(bits, 0, where=invalid[:, first:, None, :, None])
    if cache.dtype != np.float32:  # widen contiguously: a cast from a strided view is several times slower
        picked = widen(picked, workspace("widened", picked.shape, np.float32))
    wide = workspace("wide", (chunk, num_kv_heads, nb, block_size, head_size), np.float32)
    np.copyto(wide, picked.transpose(0, 2, 1, 3, 4))
    return wide.reshape(chunk, num_kv_heads, nb * block_size, head_size)


def _partition(
    q_t: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    lens: np.ndarray,
    b0: int,
    b1: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks ``b0:b1`` of a chunk: ``(max, denominator, unnormalised P @ V)``.

    ``q_t`` is float32 ``[C, kv_heads, d, group]``; the results are
    ``[C, kv_heads, 1, group]`` twice and ``[C, kv_heads, group, d]``.
    """
    block_size = key_cache.shape[2]
    chunk = q_t.shape[0]
    tokens = np.arange(b0 * block_size, b1 * block_size)
    valid = tokens[None, :] < lens[:, None]  # [C, T]
    invalid = ~valid.reshape(chunk, b1 - b0, block_size)
    used = ~invalid[:, :, 0]
    blocks = np.where(used, block_tables[:, b0:b1], 0).astype(np.intp)  # unused entries may hold anything
    scores = workspace("scores", (chunk, q_t.shape[1], tokens.size, q_t.shape[3]), np.float32)
    np.matmul(_gather(key_cache, blocks, invalid), q_t, out=scores)  # [C, kv_heads, T, group]
    scores += np.where(valid, np.float32(0), np.float32(-np.inf))[:, None, :, None]  # zero keys: finite + -inf
    top = scores.max(axis=2, keepdims=True)
    scores -= np.where(np.isfinite(top), top, np.float32(0))
    np.exp(scores, out=scores)
    denom = scores.sum(axis=2, keepdims=True)
    acc = scores.swapaxes(-1, -2) @ _gather(value_cache, blocks, invalid)  # 0 * zeroed value rows: 0
    return top, denom, acc


def _attend_varlen(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    options: AttentionOptions,
    query_start_loc: np.ndarray | None,
) -> np.ndarray:
    """The whole contract, one sequence at a time: its used K/V rows gathered in float32, scores per chunk of rows."""
    scale, window, softcap = options.scale, options.window, options.softcap
    sinks, alibi_slopes = options.sinks, options.alibi_slopes
    num_tokens, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, head_size), dtype=np.float32)
    starts = np.arange(seq_lens.shape[0] + 1) if query_start_loc is None else np.asarray(query_start_loc)
    starts = starts.astype(np.int64)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float32).reshape(num_kv_heads, group, 1, 1)
    sink = None if sinks is None else np.asarray(sinks, np.float32).reshape(num_kv_heads, group, 1, 1)
    for s, length in enumerate(seq_lens.astype(np.int64)):
        r0, r1 = int(starts[s]), int(starts[s + 1])
        if r1 == r0 or length == 0:
            continue  # no new token, or a decode row of an empty sequence: zeros
        tokens = np.arange(length)
        blocks = block_tables[s, tokens // block_size].astype(np.intp)
        keys = to_float32(key_cache[blocks, :, tokens % block_size]).transpose(1, 0, 2)  # [kv_heads, L, d]
        values = to_float32(value_cache[blocks, :, tokens % block_size]).transpose(1, 0, 2)
        for c0 in range(r0, r1, VARLEN_CHUNK_ROWS):
            c1 = min(r1, c0 + VARLEN_CHUNK_ROWS)
            pos = length - (r1 - r0) + np.arange(c0 - r0, c1 - r0)  # [n]
            lo = max(0, int(pos[0]) - window + 1) if window else 0
            rel = (np.arange(lo, int(pos[-1]) + 1)[None, :] - pos[:, None]).astype(np.float32)  # t - p: [n, keys]
            q = to_float32(query[c0:c1]).reshape(c1 - c0, num_kv_heads, group, head_size).transpose(1, 2, 0, 3)
            scores = (q * np.float32(scale)) @ keys[:, None, lo:int(pos[-1]) + 1].swapaxes(-1, -2)  # [kv, g, n, keys]
            if softcap:
                scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
            if slopes is not None:
                scores = scores + slopes * rel
            hidden = (rel > 0) | ((rel <= -window) if window else False)
            scores = np.where(hidden, np.float32(-np.inf), scores)
            top = scores.max(axis=-1, keepdims=True)
            if sink is not None:
                top = np.maximum(top, sink)
            with np.errstate(invalid="ignore"):
                probs = np.exp(scores - top)
                denom = probs.sum(axis=-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
                result = (probs @ values[:, None, lo:int(pos[-1]) + 1]) / denom  # [kv, g, n, d]
            out[c0:c1] = result.transpose(2, 0, 1, 3).reshape(c1 - c0, num_heads, head_size)
    return out
