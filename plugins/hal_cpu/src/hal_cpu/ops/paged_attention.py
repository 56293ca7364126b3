"""``paged_attention`` on the host: the compiled variable-length kernel (csrc/paged_attention.inl).

One call serves a batch mixing prompts, prompt chunks and decoding sequences
(``query_start_loc``), with an optional sliding ``window``, logit
``softcap``, ``sinks`` and ``alibi_slopes``. Rows of a sequence with one new
token run the bandwidth-bound decode task (one per sequence, or per split-KV
partition merged by log-sum-exp); sequences with several new tokens run
compute-bound tiles of query tokens per KV head (AMX for bf16/fp16 where the
CPU has it). Every used K/V row is read in its storage dtype; unused cache
slots are never read. A NaN score (a NaN query or used key), or a maximum
score of +/-inf, gives NaN for that row and head, and a non-finite visible
value reaches the result, as in the float64 reference.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hal_core.ops import OpCall

from .. import _abi, _native
from . import _fallback_attention, _knobs, _rules
from ._common import finish
from ._native_args import dtype_code, element_strides, last_contiguous

__all__ = ["attend", "paged_attention"]


#: Arguments of the variable-length contract, passed through when the call carries them.
_VARLEN = ("query_start_loc", "max_query_len", "window", "softcap", "sinks", "alibi_slopes")


def paged_attention(call: OpCall) -> np.ndarray:
    """The registered implementation: the result in the query's dtype; knobs from :mod:`._knobs`."""
    extra = {name: call.args.get(name) for name in _VARLEN}
    arrays = {name: None if extra[name] is None else np.asarray(extra[name])
              for name in ("query_start_loc", "sinks", "alibi_slopes")}
    result = attend(
        np.asarray(call["query"]), np.asarray(call["key_cache"]), np.asarray(call["value_cache"]),
        np.asarray(call["block_tables"]), np.asarray(call["seq_lens"]), call["scale"],
        query_start_loc=arrays["query_start_loc"], max_query_len=extra["max_query_len"], window=extra["window"],
        softcap=extra["softcap"], sinks=arrays["sinks"], alibi_slopes=arrays["alibi_slopes"],
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
    query_start_loc: np.ndarray | None = None,
    max_query_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    out_dtype: Any = None,
    partition_tokens: int | None = None,
    query_tile: int | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Paged attention of validated numpy inputs, as ``[num_tokens, num_heads, head_size]`` in ``out_dtype``.

    The arguments are hal-core's ``paged_attention`` contract (``query_start_loc``
    None: one new token per sequence); ``out_dtype`` is float32, float16 or
    bfloat16 (default: the query's dtype; the kernel rounds once, from float32).
    The knobs ``partition_tokens`` (0: no split), ``query_tile`` (tokens per
    prefill task) and ``threads`` default to
    :func:`~hal_cpu.ops._knobs.attention_partition` (for the threads the call
    runs on; the registered implementation's knob rule is the same function),
    :func:`~hal_cpu.ops._rules.attention_query_tile` and
    :func:`~hal_cpu.ops._knobs.attention_threads`.
    """
    out_dtype = query.dtype if out_dtype is None else np.dtype(out_dtype)
    native = _native.try_load()
    if native is None:
        result = _fallback_attention.attend(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                            query_start_loc=query_start_loc, window=window, softcap=softcap,
                                            sinks=sinks, alibi_slopes=alibi_slopes)
        return result.astype(out_dtype, copy=False)
    num_tokens, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    out = np.empty((num_tokens, num_heads, head_size), dtype=out_dtype)
    if num_tokens == 0 or head_size == 0:
        return out
    query = last_contiguous(query)
    key_cache, value_cache = last_contiguous(key_cache), last_contiguous(value_cache)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
    keep: list[np.ndarray] = []  # arrays whose addresses the struct holds

    def address(array: np.ndarray | None, dtype: Any) -> int | None:
        if array is None:
            return None
        array = np.ascontiguousarray(array, dtype=dtype)
        keep.append(array)
        return _native.pointer(array)

    q_lens = None if query_start_loc is None else np.diff(np.asarray(query_start_loc, dtype=np.int64))
    if max_query_len is None:
        max_query_len = 1 if q_lens is None else int(q_lens.max(initial=0))
    if threads is None:
        threads = _knobs.attention_threads(seq_lens, q_lens, num_heads, num_kv_heads, head_size, key_cache.itemsize,
                                           native.threads)
    if partition_tokens is None:
        partition_tokens = _knobs.attention_partition(seq_lens, q_lens, num_kv_heads, block_size, threads)
    if query_tile is None:
        query_tile = _rules.attention_query_tile(num_heads, num_kv_heads)
    qs, qh, _ = element_strides(query)
    kb, kh, kt, _ = element_strides(key_cache)
    vb, vh, vt, _ = element_strides(value_cache)
    args = _abi.AttentionArgs(
        query=_native.pointer(query), q_token_stride=qs, q_head_stride=qh,
        key_cache=_native.pointer(key_cache), value_cache=_native.pointer(value_cache),
        k_block_stride=kb, k_head_stride=kh, k_token_stride=kt, v_block_stride=vb, v_head_stride=vh, v_token_stride=vt,
        block_tables=_native.pointer(block_tables), bt_stride=block_tables.shape[1], seq_lens=_native.pointer(seq_lens),
        query_start_loc=address(query_start_loc, np.int32), sinks=address(sinks, np.float32),
        alibi_slopes=address(alibi_slopes, np.float32), out=_native.pointer(out),
        out_token_stride=num_heads * head_size, out_dtype=dtype_code(out), num_seqs=num_seqs, num_tokens=num_tokens,
        num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, head_size=head_size,
        dtype=dtype_code(query), max_query_len=int(max_query_len), window=int(window or 0), scale=scale,
        softcap=float(softcap or 0.0), partition_tokens=int(partition_tokens), query_tile=int(query_tile),
        threads=int(threads),
    )
    if native.lib.hal_cpu_paged_attention(ctypes.byref(args)):
        raise MemoryError("paged_attention: the CPU kernel could not allocate its workspace")
    return out
