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
from collections.abc import Mapping
from typing import Any

import numpy as np

from hal_core.ops import AttentionOptions, OpCall, Runner
from hal_core.ops.paged_attention_options import ATTENTION_OPTIONS

from .. import _abi, _native
from . import _fallback_attention, _knobs, _rules
from ._common import finish
from ._native_args import DTYPE_CODES, dtype_code, element_strides, fill_struct, last_contiguous

__all__ = ["attend", "paged_attention", "plan_paged_attention"]


def paged_attention(call: OpCall) -> np.ndarray:
    """The registered implementation: the result in the query's dtype; knobs from :mod:`._knobs`."""
    args = call.args
    max_query_len = args.get("max_query_len")
    result = attend(args["query"], args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"],
                    call.options, query_start_loc=args.get("query_start_loc"),
                    max_query_len=_knobs.call_lengths(call).longest_query if max_query_len is None else max_query_len,
                    partition_tokens=_knobs.partition_tokens(call), threads=_knobs.call_threads(call))
    return finish(call, result)


def attend(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    options: AttentionOptions | float,
    *,
    query_start_loc: np.ndarray | None = None,
    max_query_len: int | None = None,
    out_dtype: Any = None,
    partition_tokens: int | None = None,
    query_tile: int | None = None,
    threads: int | None = None,
    **flat_options: Any,
) -> np.ndarray:
    """Paged attention of validated numpy inputs, as ``[num_tokens, num_heads, head_size]`` in ``out_dtype``.

    The arguments are hal-core's ``paged_attention`` contract (``query_start_loc``
    None: one new token per sequence); ``options`` is the layer's
    :class:`~hal_core.ops.AttentionOptions`, or its scale alone with the other
    options as keywords (``attend(..., 0.125, window=64)``). The kernel's
    argument struct takes each option by its field name. ``out_dtype`` is float32,
    float16 or bfloat16 (default: the query's dtype; the kernel rounds once, from float32).
    The knobs ``partition_tokens`` (0: no split), ``query_tile`` (tokens per
    prefill task) and ``threads`` default to
    :func:`~hal_cpu.ops._knobs.attention_partition` (for the threads the call
    runs on; the registered implementation's knob rule is the same function),
    :func:`~hal_cpu.ops._rules.attention_query_tile` and
    :func:`~hal_cpu.ops._knobs.attention_threads`.
    """
    options = _fallback_attention.layer_options(options, flat_options)
    out_dtype = query.dtype if out_dtype is None else np.dtype(out_dtype)
    native = _native.try_load()
    if native is None:
        result = _fallback_attention.attend(query, key_cache, value_cache, block_tables, seq_lens, options,
                                            query_start_loc=query_start_loc)
        return result.astype(out_dtype, copy=False)
    given = ATTENTION_OPTIONS.flat(options)  # scale, window, softcap, sinks, alibi_slopes: the struct's names
    num_tokens, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    out = np.empty((num_tokens, num_heads, head_size), dtype=out_dtype)
    if num_tokens == 0 or head_size == 0:
        return out
    query = last_contiguous(query)
    key_cache, value_cache = last_contiguous(key_cache), last_contiguous(value_cache)
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
    if query_start_loc is not None:
        query_start_loc = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    for name in ("sinks", "alibi_slopes"):  # float32 [num_heads] (an array the front door checked already is)
        if given[name] is not None:
            given[name] = np.ascontiguousarray(given[name], dtype=np.float32)
    if max_query_len is None or threads is None or partition_tokens is None:
        lengths = _knobs.attention_lengths(seq_lens, query_start_loc)
        if max_query_len is None:
            max_query_len = lengths.longest_query
        if threads is None:
            threads = _knobs.attention_threads(lengths, num_heads, num_kv_heads, head_size, key_cache.itemsize,
                                               native.threads)
        if partition_tokens is None:
            partition_tokens = _knobs.attention_partition(lengths, num_kv_heads, block_size, threads)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    args = fill_struct(_abi.AttentionArgs, {
        **_fields(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, given, out_dtype,
                  query_tile), "out": out, "max_query_len": max_query_len, "partition_tokens": partition_tokens,
        "threads": threads})
    if native.lib.hal_cpu_paged_attention(ctypes.byref(args)):
        raise MemoryError("paged_attention: the CPU kernel could not allocate its workspace")
    return out


def _fields(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_tables: np.ndarray,
            seq_lens: np.ndarray, query_start_loc: np.ndarray | None, given: dict[str, Any], out_dtype: np.dtype,
            query_tile: int | None) -> dict[str, Any]:
    """The kernel's argument struct, by field, but the output and what a call's lengths decide (``out``,
    ``max_query_len``, ``partition_tokens``, ``threads``)."""
    num_tokens, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    qs, qh, _ = element_strides(query)
    kb, kh, kt, _ = element_strides(key_cache)
    vb, vh, vt, _ = element_strides(value_cache)
    return {
        **given, "query": query, "q_token_stride": qs, "q_head_stride": qh, "key_cache": key_cache,
        "value_cache": value_cache, "k_block_stride": kb, "k_head_stride": kh, "k_token_stride": kt,
        "v_block_stride": vb, "v_head_stride": vh, "v_token_stride": vt, "block_tables": block_tables,
        "bt_stride": block_tables.shape[1], "seq_lens": seq_lens, "query_start_loc": query_start_loc,
        "out_token_stride": num_heads * head_size, "out_dtype": DTYPE_CODES[np.dtype(out_dtype)],
        "num_seqs": seq_lens.shape[0], "num_tokens": num_tokens, "num_heads": num_heads,
        "num_kv_heads": num_kv_heads, "block_size": block_size, "head_size": head_size,
        "dtype": dtype_code(query),
        "query_tile": _rules.attention_query_tile(num_heads, num_kv_heads) if query_tile is None else query_tile,
    }


def plan_paged_attention(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`): per call, the lengths' threads and partitions
    (:mod:`._knobs`, as the implementation reads them) and the addresses; None where the kernel cannot take the
    call's arrays as they are (index arrays other than contiguous int32, option arrays other than float32)."""
    native = _native.try_load()
    args = call.args
    query, key_cache, value_cache = args["query"], args["key_cache"], args["value_cache"]
    given = ATTENTION_OPTIONS.flat(call.options)
    block_tables, seq_lens, query_start_loc = args["block_tables"], args["seq_lens"], args.get("query_start_loc")
    indices = (block_tables, seq_lens, query_start_loc)
    if native is None or 0 in query.shape or any(last_contiguous(a) is not a for a in (query, key_cache, value_cache)) \
            or any(a is not None and (a.dtype != np.int32 or not a.flags.c_contiguous) for a in indices) \
            or any(given[name] is not None and (given[name] is not args.get(name) or given[name].dtype != np.float32
                                                or not given[name].flags.c_contiguous)
                   for name in ("sinks", "alibi_slopes")):
        return None
    fields = _fields(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, given, query.dtype, None)
    template = fill_struct(_abi.AttentionArgs, {**fields, "out": None, "max_query_len": 0, "partition_tokens": 0,
                                                "threads": 1})
    pointers = tuple((name, name) for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                                               "query_start_loc", "sinks", "alibi_slopes")
                     if name not in call.fixed and fields[name] is not None)
    kernel, copy, pointer, byref = native.lib.hal_cpu_paged_attention, _abi.AttentionArgs.from_buffer_copy, \
        _native.pointer, ctypes.byref
    shape, dtype = query.shape, query.dtype
    kept = call.signature_only()

    def run(args: Mapping[str, Any]) -> np.ndarray:
        each = kept.with_args(args)  # the knobs read the call's lengths through it
        filled = copy(template)
        for field, name in pointers:
            setattr(filled, field, pointer(args[name]))
        max_query_len = args.get("max_query_len")
        filled.max_query_len = _knobs.call_lengths(each).longest_query if max_query_len is None else max_query_len
        filled.partition_tokens = _knobs.partition_tokens(each)
        filled.threads = _knobs.call_threads(each)
        out = np.empty(shape, dtype)
        filled.out = pointer(out)
        if kernel(byref(filled)):
            raise MemoryError("paged_attention: the CPU kernel could not allocate its workspace")
        return out

    return run
