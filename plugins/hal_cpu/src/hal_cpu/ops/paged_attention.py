"""``paged_attention`` on the host: the compiled kernel (csrc/kernels.cpp), one task per (sequence, KV head, partition).

Each task walks its sequence's block table and reads every used K/V row once,
in its storage dtype (fp16/bf16/fp32, widened in registers), for all query
heads of its GQA group; the softmax is online, in float32. Sequences are
split into partitions (split-KV) when there are too few (sequence, KV head)
pairs for the cores; partitions merge by log-sum-exp. Unused cache slots are
never read. A NaN score (a NaN query or used key), or a maximum score of
+/-inf, gives NaN for that head, and a non-finite used value reaches the
result, as in the float64 reference.
"""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall
from hal_core.ops.paged_attention import variants

from .. import _native
from . import _fallback_attention, _knobs, _rules
from ._common import finish
from ._native_args import dtype_code, element_strides, last_contiguous

__all__ = ["attend", "paged_attention", "supports"]


def supports(call: OpCall) -> bool | str:
    """Decode over any cache layout; the compiled kernel has no prefill, window, softcap, sinks or ALiBi."""
    args = call.args
    if all(args.get(name) is None for name in _LATER):
        return True
    missing = sorted(variants(args) - {"strided_cache"})
    return f"the compiled kernel runs decode only, not {', '.join(missing)}" if missing else True


#: Arguments of the op the compiled decode kernel does not take (it runs calls that give none of them).
_LATER = ("query_start_loc", "window", "softcap", "sinks", "alibi_slopes")


def paged_attention(call: OpCall) -> np.ndarray:
    """The registered implementation: float32 result; the partition size is the ``partition_tokens`` knob."""
    result = attend(
        np.asarray(call["query"]), np.asarray(call["key_cache"]), np.asarray(call["value_cache"]),
        np.asarray(call["block_tables"]), np.asarray(call["seq_lens"]), call["scale"],
        partition_tokens=_knobs.partition_tokens(call),
    )
    return finish(call, result)


def attend(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    *,
    partition_tokens: int | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Paged decode attention of validated numpy inputs, as float32 ``[num_seqs, num_heads, head_size]``.

    ``partition_tokens`` (0: no split) and ``threads`` default to
    :func:`~hal_cpu.ops._rules.attention_partition_tokens` and
    :func:`~hal_cpu.ops._rules.threads_for`.
    """
    native = _native.try_load()
    if native is None:
        return _fallback_attention.attend(query, key_cache, value_cache, block_tables, seq_lens, scale)
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    out = np.empty((num_seqs, num_heads, head_size), dtype=np.float32)
    if num_seqs == 0 or head_size == 0:
        return out
    query = last_contiguous(query)
    if key_cache.strides != value_cache.strides:
        key_cache, value_cache = np.ascontiguousarray(key_cache), np.ascontiguousarray(value_cache)
    key_cache, value_cache = last_contiguous(key_cache), last_contiguous(value_cache)
    if key_cache.strides != value_cache.strides:
        key_cache, value_cache = np.ascontiguousarray(key_cache), np.ascontiguousarray(value_cache)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
    if threads is None or partition_tokens is None:
        total = int(seq_lens.sum(dtype=np.int64))
        kv_bytes = 2 * total * num_kv_heads * head_size * key_cache.itemsize
        threads = _rules.threads_for(kv_bytes, native.threads) if threads is None else threads
        if partition_tokens is None:
            max_len = int(seq_lens.max()) if num_seqs else 0
            partition_tokens = _rules.attention_partition_tokens(num_seqs, num_kv_heads, max_len, block_size, threads)
    qs, qh, _ = element_strides(query)
    cb, ch, ct, _ = element_strides(key_cache)
    rc = native.lib.hal_cpu_paged_attention(
        _native.pointer(query), qs, qh, _native.pointer(key_cache), _native.pointer(value_cache), cb, ch, ct,
        _native.pointer(block_tables), block_tables.shape[1], _native.pointer(seq_lens), _native.pointer(out),
        num_seqs, num_heads, num_kv_heads, block_size, head_size, dtype_code(query), scale,
        int(partition_tokens), int(threads))
    if rc:
        raise MemoryError("paged_attention: the CPU kernel could not allocate its partition workspace")
    return out
