"""The CPU kernels' tunables as :class:`hal_core.tuning.Knob` objects: ``hal tune`` measures them per device.

Each knob's built-in rule is the matching pure function of :mod:`._rules`;
the op wrappers read ``knob.value(call)``, which is a persisted per-device
winner for the call's shape bucket when ``hal tune`` stored one, else that
rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from hal_core.ops import OpCall
from hal_core.tuning import Knob

from .. import _native
from . import _rules

__all__ = ["GEMM_KERNEL", "PARTITION_TOKENS", "SMALL_BATCH", "AttentionLengths", "attention_lengths",
           "attention_partition", "attention_threads", "call_lengths", "call_threads", "host_isa", "host_threads",
           "partition_tokens"]


def host_threads() -> int:
    """Worker threads of the compiled kernels' pool (1 when the library is not loaded)."""
    native = _native.try_load()
    return native.threads if native is not None else 1


#: Sequences up to which a call's lengths are read as Python ints (a decode step's few sequences): a numpy
#: reduction costs microseconds on arrays this small, several times more with the caches cold inside a model.
SMALL_BATCH = 64


@dataclass(frozen=True)
class AttentionLengths:
    """What a ``paged_attention`` call's lengths decide its threads and partitions by (:func:`attention_lengths`)."""

    #: Σ seq_lens: the keys the call reads per KV head.
    total: int
    #: The longest sequence (0 for none).
    longest: int
    #: Sequences with one new token (every sequence without ``query_start_loc``).
    decode_rows: int
    #: Σ q_len · seq_len: (new token, key) pairs, 0 without ``query_start_loc``.
    pairs: int
    #: The most new tokens of a sequence (1 without ``query_start_loc``, 0 for no sequence).
    longest_query: int


def attention_lengths(seq_lens: np.ndarray, query_start_loc: np.ndarray | None) -> AttentionLengths:
    """The sums and maxima of a call's host ``seq_lens`` and ``query_start_loc`` (validated), computed once per call:
    as Python ints up to :data:`SMALL_BATCH` sequences, by numpy above."""
    if seq_lens.shape[0] <= SMALL_BATCH:
        lens = seq_lens.tolist()
        if query_start_loc is None:
            return AttentionLengths(sum(lens), max(lens, default=0), len(lens), 0, 1 if lens else 0)
        starts = query_start_loc.tolist()
        q_lens = [b - a for a, b in pairwise(starts)]
        return AttentionLengths(sum(lens), max(lens, default=0), q_lens.count(1),
                                sum(q * n for q, n in zip(q_lens, lens, strict=True)), max(q_lens, default=0))
    total, longest = int(seq_lens.sum(dtype=np.int64)), int(seq_lens.max(initial=0))
    if query_start_loc is None:
        return AttentionLengths(total, longest, seq_lens.shape[0], 0, 1)
    q = np.diff(query_start_loc.astype(np.int64))
    return AttentionLengths(total, longest, int((q == 1).sum()), int((q * seq_lens).sum(dtype=np.int64)),
                            int(q.max(initial=0)))


def call_lengths(call: OpCall) -> AttentionLengths:
    """:func:`attention_lengths` of a validated call, computed once and kept with the call (the knob's rule and the
    wrapper both read it)."""
    found = call.__dict__.get("_hal_cpu_lengths")
    if found is None:
        qsl = call.args.get("query_start_loc")
        found = attention_lengths(np.asarray(call["seq_lens"]), None if qsl is None else np.asarray(qsl))
        call.__dict__["_hal_cpu_lengths"] = found  # a frozen dataclass: set as functools.cached_property does
    return found


def attention_threads(lengths: AttentionLengths, num_heads: int, num_kv_heads: int, head_size: int, itemsize: int,
                      host: int) -> int:
    """Threads a ``paged_attention`` call runs on (:func:`._rules.threads_for`), by the larger of the K/V bytes
    it reads and an eighth of its FLOPs."""
    kv_bytes = 2 * lengths.total * num_kv_heads * head_size * itemsize
    flops = 4 * head_size * num_heads * lengths.pairs
    return _rules.threads_for(max(kv_bytes, flops // 8), host)


def attention_partition(lengths: AttentionLengths, num_kv_heads: int, block_size: int, threads: int) -> int:
    """Tokens per split-KV partition of a ``paged_attention`` call run on ``threads`` threads (the rule:
    :func:`._rules.attention_partition_tokens` over its decode rows, the sequences with one new token)."""
    return _rules.attention_partition_tokens(lengths.decode_rows, num_kv_heads, lengths.longest, block_size, threads)


def call_threads(call: OpCall) -> int:
    """:func:`attention_threads` of a validated call (the wrapper's default, and what the partition rule sizes for),
    computed once and kept with the call as :func:`call_lengths` is."""
    found = call.__dict__.get("_hal_cpu_threads")
    if found is None:
        key_cache = call["key_cache"]
        _, num_kv_heads, _, head_size = key_cache.shape
        found = attention_threads(call_lengths(call), call["query"].shape[1], num_kv_heads, head_size,
                                  key_cache.itemsize, host_threads())
        call.__dict__["_hal_cpu_threads"] = found
    return found


def _partition_rule(call: OpCall) -> int:
    # Sized for the threads the kernel will run on: the wrapper's own default (call_threads), the same rule.
    _, num_kv_heads, block_size, _ = call["key_cache"].shape
    return attention_partition(call_lengths(call), num_kv_heads, block_size, call_threads(call))


def host_isa() -> str:
    """The instruction-set variant the compiled kernels run (``'baseline'`` when the library is not loaded)."""
    native = _native.try_load()
    return native.isa if native is not None else "baseline"


def _gemm_kernel_rule(call: OpCall) -> str:
    """The rules' kernel for the rows each block of ``call`` has (:func:`hal_cpu.ops._rules.row_spans`): what
    runs, and what ``hal info --explain`` reports, where a call of many rows runs in blocks."""
    qweight, x = call["qweight"], call["x"]
    native = _native.try_load()
    half = native is not None and x.dtype.itemsize == 2 and bool(native.lib.hal_cpu_w4a16_half_dot())
    act_order = qweight.g_idx is not None
    block = _rules.gemm_row_block(qweight.bits == 8, half and not act_order and qweight.group_size % 8 == 0,
                                  x.dtype.itemsize == 4)
    start, stop = _rules.row_spans(x.shape[0], block)[0]
    return _rules.gemm_kernel(stop - start, qweight.bits, qweight.group_size, act_order, host_isa(), half)


#: paged_attention: tokens per split-KV partition (0: no split).
PARTITION_TOKENS = Knob("partition_tokens", (0, 256, 512, 1024, 2048), rule=_partition_rule,
                        doc="tokens per split-KV partition (0: one task per sequence and KV head)")
def partition_tokens(call: OpCall) -> int:
    """The ``partition_tokens`` value for ``call`` (a stored winner or the rule)."""
    value = PARTITION_TOKENS.value(call)
    return value if isinstance(value, int) else _partition_rule(call)


#: quantized_gemm W4A16: the in-register kernel, the blocked GEMM on dequantised panels, or dequantised tiles fed
#: to BLAS (the small-M / large-M crossover).
GEMM_KERNEL = Knob("kernel", ("registers", "blocked", "tiles"), rule=_gemm_kernel_rule,
                   doc="W4A16: 'registers' (int4 unpacked in registers), 'blocked' (cache-blocked GEMM on "
                       "dequantised L2-sized panels) or 'tiles' (dequantised tiles + BLAS)")
