"""``paged_attention``: decode attention over a paged KV cache.

Layout (the one every backend uses):

- ``query``        ``[num_seqs, num_heads, head_size]``
- ``key_cache``    ``[num_blocks, num_kv_heads, block_size, head_size]``
- ``value_cache``  same shape and dtype as ``key_cache``
- ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]``
- ``seq_lens``     int32 ``[num_seqs]``

Token ``t`` of sequence ``s`` lives at
``key_cache[block_tables[s, t // block_size], kv_head, t % block_size]``.
Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA/MQA).
``out[s, h] = softmax(scale * q[s, h] . K_t) @ V_t`` over ``t < seq_lens[s]``;
a sequence of length 0 gives zeros. Only blocks holding used tokens are read,
so table entries past a sequence's last block may hold anything.

``max_seq_len`` (optional, a positive int checked on the host) is an upper
bound on every ``seq_lens`` entry that the caller knows without reading the
device (an engine's longest context this step). Device backends size their
partitions and workspaces from it; without it they size them from the block
table's capacity (``max_blocks_per_seq * block_size``). A length beyond it is
an index error like a length beyond the table.

Index values (``block_tables`` entries of used blocks, ``seq_lens``) of host
(numpy) arrays are checked before any work (``HAL_CHECK_INDICES``); those of
device arrays are checked by the kernels, which zero the output rows of a
sequence with a bad entry and report the argument through the device error
flag (:func:`hal_core.check_errors`). Nothing is read back to the host.

Non-finite inputs follow IEEE arithmetic in that formula, with the softmax
taken as ``exp(x - max) / sum(exp(x - max))`` (what :meth:`PagedAttention.reference`
computes in float64): when the largest score of a head is NaN or infinite
(NaN anywhere in ``q[s, h]`` or in a used key it reads, an infinite score)
the whole ``out[s, h]`` row is NaN; a NaN or infinite element of a used
value row reaches the output elements it weights (NaN, or an infinity of
that sign). Cache slots no used token occupies never reach a result,
whatever they hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import ArgumentTypeError
from ..arrays import device_of, dtype_name, numpy_dtype
from ._checks import check_array, check_block_tables, fail, host_index_checks
from ._spec import OpSpec

__all__ = ["PagedAttention", "attention_dtypes"]

#: dtypes paged_attention accepts for query and caches.
attention_dtypes = ("fp32", "fp16", "bf16")


class PagedAttention(OpSpec):
    name = "paged_attention"
    array_args = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "out")

    def validate(self, args: dict[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> None:
        q, kc, vc = args["query"], args["key_cache"], args["value_cache"]
        bt, sl = args["block_tables"], args["seq_lens"]
        qdt = check_array("query", q, layout="[num_seqs, num_heads, head_size]", ndim=3, dtypes=attention_dtypes)
        kdt = check_array("key_cache", kc, layout="[num_blocks, num_kv_heads, block_size, head_size]",
                          ndim=4, dtypes=attention_dtypes)
        check_array("value_cache", vc, layout="[num_blocks, num_kv_heads, block_size, head_size]",
                    ndim=4, dtypes=(kdt,))
        if kdt != qdt:
            raise ArgumentTypeError(f"argument 'key_cache': expected dtype {qdt} (the query's), got {kdt}")
        check_array("block_tables", bt, layout="[num_seqs, max_blocks_per_seq]", ndim=2, dtypes=("int32",))
        check_array("seq_lens", sl, layout="[num_seqs]", ndim=1, dtypes=("int32",))
        num_seqs, num_heads, head_size = q.shape
        _, num_kv_heads, block_size, kv_head_size = kc.shape
        if tuple(vc.shape) != tuple(kc.shape):
            raise fail("value_cache", f"the shape of key_cache {tuple(kc.shape)}", f"shape {tuple(vc.shape)}")
        if kv_head_size != head_size:
            raise fail("key_cache", f"head_size {head_size} (query's last dimension) in dimension 3",
                       f"shape {tuple(kc.shape)}")
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise fail("key_cache", f"num_kv_heads dividing num_heads={num_heads} in dimension 1",
                       f"num_kv_heads={num_kv_heads}")
        if block_size == 0:
            raise fail("key_cache", "block_size >= 1 in dimension 2", f"shape {tuple(kc.shape)}")
        if bt.shape[0] != num_seqs:
            raise fail("block_tables", f"{num_seqs} rows (num_seqs)", f"shape {tuple(bt.shape)}")
        if sl.shape[0] != num_seqs:
            raise fail("seq_lens", f"shape ({num_seqs},) (num_seqs)", f"shape {tuple(sl.shape)}")
        scale = _real(args["scale"])
        if scale is None or not math.isfinite(scale):
            raise ArgumentTypeError(f"argument 'scale': expected a finite float, got {args['scale']!r}")
        args["scale"] = scale
        out = args.get("out")
        if out is not None:
            check_array("out", out, layout="[num_seqs, num_heads, head_size]", ndim=3, dtypes=(qdt,))
            if tuple(out.shape) != tuple(q.shape):
                raise fail("out", f"shape {tuple(q.shape)} (the query's)", f"shape {tuple(out.shape)}")
        max_seq_len = args.get("max_seq_len")
        if max_seq_len is not None:
            if isinstance(max_seq_len, (bool, np.bool_)) or not isinstance(max_seq_len, (int, np.integer)) \
                    or max_seq_len <= 0:
                raise ArgumentTypeError(f"argument 'max_seq_len': expected a positive int (or None), "
                                        f"got {max_seq_len!r}")
            args["max_seq_len"] = max_seq_len = int(max_seq_len)
        if num_seqs and host_index_checks(bt, sl):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Lengths in ``[0, min(capacity, max_seq_len)]``, used table entries in ``[0, num_blocks)`` (host arrays)."""
        num_blocks, _, block_size, _ = args["key_cache"].shape
        check_block_tables(np.asarray(args["block_tables"]), np.asarray(args["seq_lens"]), num_blocks, block_size,
                           args.get("max_seq_len"))

    def output_shape(self, args: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(args["query"].shape)

    def output_dtype(self, args: Mapping[str, Any]) -> np.dtype:
        return numpy_dtype(dtype_name(args["query"]))

    def flops(self, args: Mapping[str, Any]) -> int:
        num_seqs, num_heads, head_size = args["query"].shape
        total_tokens = int(_host_int_sum(args["seq_lens"])) if num_seqs else 0
        # q.k and p.v: 2 FMAs per element, plus softmax (~5 flops per score).
        return total_tokens * num_heads * (4 * head_size + 5)

    def nbytes(self, args: Mapping[str, Any]) -> int:
        """Bytes of K and V read (once per KV head) plus query and output."""
        q, kc = args["query"], args["key_cache"]
        num_seqs, _, head_size = q.shape
        num_kv_heads = kc.shape[1]
        item = q.dtype.itemsize
        total_tokens = int(_host_int_sum(args["seq_lens"])) if num_seqs else 0
        kv = 2 * total_tokens * num_kv_heads * head_size * item
        return kv + 2 * int(np.prod(q.shape)) * item

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        q = np.asarray(args["query"]).astype(np.float64)
        kc = np.asarray(args["key_cache"]).astype(np.float64)
        vc = np.asarray(args["value_cache"]).astype(np.float64)
        bt, sl, scale = np.asarray(args["block_tables"]), np.asarray(args["seq_lens"]), args["scale"]
        num_seqs, num_heads, _head_size = q.shape
        _, num_kv_heads, block_size, _ = kc.shape
        group = num_heads // num_kv_heads
        out = np.zeros(q.shape, dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs propagate (module docs)
            for s in range(num_seqs):
                n = int(sl[s])
                if n == 0:
                    continue
                t = np.arange(n)
                blocks = bt[s, t // block_size]
                keys = kc[blocks, :, t % block_size]  # [n, kv_heads, d]
                values = vc[blocks, :, t % block_size]
                keys = np.repeat(keys, group, axis=1)  # [n, heads, d]
                values = np.repeat(values, group, axis=1)
                scores = np.einsum("hd,nhd->hn", q[s], keys) * scale
                scores -= scores.max(axis=1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=1, keepdims=True)
                out[s] = np.einsum("hn,nhd->hd", p, values)
        return out


def _real(value: Any) -> float | None:
    """``value`` as a float: a Python or numpy real scalar or a 0-d real numpy array (never a bool); else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return float(value)
    return None


def _host_int_sum(array: Any) -> int:
    if device_of(array)[0] == "cpu":
        return int(np.asarray(array).sum(dtype=np.int64))
    return int(array.sum())
