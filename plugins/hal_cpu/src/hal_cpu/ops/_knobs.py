"""The CPU kernels' tunables as :class:`hal_core.tuning.Knob` objects: ``hal tune`` measures them per device.

Each knob's built-in rule is the matching pure function of :mod:`._rules`;
the op wrappers read ``knob.value(call)``, which is a persisted per-device
winner for the call's shape bucket when ``hal tune`` stored one, else that
rule.
"""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall
from hal_core.tuning import Knob

from .. import _native
from . import _rules

__all__ = ["GEMM_KERNEL", "PARTITION_TOKENS", "attention_partition", "attention_threads", "host_isa", "host_threads",
           "partition_tokens"]


def host_threads() -> int:
    """Worker threads of the compiled kernels' pool (1 when the library is not loaded)."""
    native = _native.try_load()
    return native.threads if native is not None else 1


def attention_threads(seq_lens: np.ndarray, q_lens: np.ndarray | None, num_heads: int, num_kv_heads: int,
                      head_size: int, itemsize: int, host: int) -> int:
    """Threads a ``paged_attention`` call runs on (:func:`._rules.threads_for`), by the larger of the K/V bytes
    it reads and an eighth of its FLOPs; ``q_lens``: new tokens per sequence (None: one each)."""
    kv_bytes = 2 * int(seq_lens.sum(dtype=np.int64)) * num_kv_heads * head_size * itemsize
    flops = 0 if q_lens is None else 4 * head_size * num_heads * int((q_lens * seq_lens).sum(dtype=np.int64))
    return _rules.threads_for(max(kv_bytes, flops // 8), host)


def attention_partition(seq_lens: np.ndarray, q_lens: np.ndarray | None, num_kv_heads: int, block_size: int,
                        threads: int) -> int:
    """Tokens per split-KV partition of a ``paged_attention`` call run on ``threads`` threads (the rule:
    :func:`._rules.attention_partition_tokens` over its decode rows, the sequences with one new token)."""
    decode = seq_lens.shape[0] if q_lens is None else int((q_lens == 1).sum())
    return _rules.attention_partition_tokens(decode, num_kv_heads, int(seq_lens.max(initial=0)), block_size, threads)


def _partition_rule(call: OpCall) -> int:
    # Sized for the threads the kernel will run on: the wrapper's own default (attention_threads), the same rule.
    key_cache, seq_lens = call["key_cache"], np.asarray(call["seq_lens"])
    starts = call.args.get("query_start_loc")
    q_lens = None if starts is None else np.diff(np.asarray(starts, dtype=np.int64))
    _, num_kv_heads, block_size, head_size = key_cache.shape
    threads = attention_threads(seq_lens, q_lens, call["query"].shape[1], num_kv_heads, head_size,
                                key_cache.itemsize, host_threads())
    return attention_partition(seq_lens, q_lens, num_kv_heads, block_size, threads)


def host_isa() -> str:
    """The instruction-set variant the compiled kernels run (``'baseline'`` when the library is not loaded)."""
    native = _native.try_load()
    return native.isa if native is not None else "baseline"


def _gemm_kernel_rule(call: OpCall) -> str:
    qweight, x = call["qweight"], call["x"]
    native = _native.try_load()
    half = native is not None and x.dtype.itemsize == 2 and bool(native.lib.hal_cpu_w4a16_half_dot())
    return _rules.gemm_kernel(x.shape[0], qweight.bits, qweight.group_size, qweight.g_idx is not None, host_isa(),
                              half)


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
