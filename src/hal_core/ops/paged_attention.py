"""``paged_attention``: attention over a paged KV cache for a packed batch mixing prompts, prompt chunks and decodes.

Layout (the one every backend uses):

- ``query``        ``[num_tokens, num_heads, head_size]``: the new tokens of every sequence, packed
- ``key_cache``    ``[num_blocks, num_kv_heads, block_size, head_size]``: any non-negative strides with a
  contiguous last dimension (an engine's own cache layout, e.g. the K half of a ``[..., 2 * block_size,
  head_size]`` view)
- ``value_cache``  same shape and dtype as ``key_cache`` (its own strides; never overlapping ``key_cache``)
- ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]``
- ``seq_lens``     int32 ``[num_seqs]``: each sequence's context length, its new tokens included
- ``query_start_loc`` int32 ``[num_seqs + 1]`` (optional): sequence ``s`` owns query rows
  ``query_start_loc[s]:query_start_loc[s + 1]``; it starts at 0, never decreases and ends at
  ``num_tokens``. Without it every sequence has exactly one new token (decode: ``num_tokens == num_seqs``).

Token ``t`` of sequence ``s`` lives at
``key_cache[block_tables[s, t // block_size], kv_head, t % block_size]``; the keys and values of a
step's new tokens are written (``write_kv_cache``) before the call. Query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)`` (GQA/MQA).

For sequence ``s`` with ``q_len`` new tokens and ``L = seq_lens[s]`` keys (``q_len <= L``), new token
``i`` sits at position ``p = L - q_len + i`` (causal, aligned bottom-right) and attends the keys
``t <= p`` — with ``window``, only the last ``window`` of them (``t > p - window``). Its scores are
``x_t = scale * q . k_t``, then ``softcap * tanh(x_t / softcap)`` with ``softcap``, then
``+ alibi_slopes[h] * (t - p)`` with ALiBi; ``out = softmax(x) @ V`` where, with ``sinks``, the softmax's
denominator also holds ``exp(sinks[h])`` (an extra logit per head that weights no value; the running
maximum includes it). A decode sequence of length 0 gives zeros. Only blocks holding used tokens are
read, so table entries past a sequence's last block may hold anything.

``max_seq_len`` and ``max_query_len`` (optional host ints) bound every ``seq_lens`` entry and every
``q_len``; device backends plan partitions, tiles and workspaces from them without reading the
device (without them, from the block table's capacity and ``num_tokens``). A value beyond a bound is
an index error like a length beyond the table.

Index values (``block_tables`` entries of used blocks, ``seq_lens``, ``query_start_loc``) of host
(numpy) arrays are checked before any work (``HAL_CHECK_INDICES``); those of device arrays are
checked by the kernels, which zero the output rows of a sequence with a bad entry and report the
argument through the device error flag (:func:`hal_core.check_errors`). Nothing is read back to the host.

Non-finite inputs follow IEEE arithmetic in that formula, with the softmax taken as
``exp(x - max) / sum(exp(x - max))`` over the keys a token attends (what
:meth:`PagedAttention.reference` computes in float64): when the largest of a head's scores is NaN or
infinite (NaN in ``q`` or in a key it attends, an infinite score) that head's whole output row is NaN;
a NaN or infinite element of an attended value row reaches the output elements it weights. Keys a token
does not attend, and cache slots no used token occupies, never reach a result, whatever they hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import ArgumentError
from ..arrays import device_of, dtype_name, is_c_contiguous
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import SMALL_INDEX_ARRAY, check_block_tables, check_disjoint, fail, host_index_checks
from ._declare import Arg, Feature, Output
from ._index_memo import PassedIndices
from ._spec import OpSpec
from .paged_attention_cases import PAGED_ATTENTION_BENCH, attention_dtypes, paged_attention_inputs
from .paged_attention_options import ATTENTION_OPTIONS, AttentionOptions

__all__ = ["AttentionOptions", "PagedAttention", "attention_dtypes", "is_prefill", "paged_attention_inputs",
           "variants"]

_CACHE = "[num_blocks, num_kv_heads, block_size, head_size]"

#: The last block tables, lengths and query offsets whose checks passed (a step's layers share them).
_PASSED = PassedIndices()


def variants(args: Mapping[str, Any]) -> frozenset[str]:
    """The optional behaviours a call uses (what a backend's coverage must declare to claim it)."""
    found = ATTENTION_OPTIONS.used_variants(args)  # the options given: "window", "softcap", ...
    if is_prefill(args):
        found.add("prefill")
    if not (is_c_contiguous(args["key_cache"]) and is_c_contiguous(args["value_cache"])):
        found.add("strided_cache")
    return frozenset(found)


def is_prefill(args: Mapping[str, Any]) -> bool:
    """Whether a validated call may give a sequence more than one new token (else it is pure decode)."""
    if args.get("query_start_loc") is None:
        return False
    return not (args.get("max_query_len") == 1 and args["query"].shape[0] == args["seq_lens"].shape[0])


class PagedAttention(OpSpec):
    """Attention over a paged KV cache: prefill, chunked prefill and decode in one packed batch."""

    name = "paged_attention"
    args = (
        Arg.array("query", "[num_tokens, num_heads, head_size]", dtypes=attention_dtypes, contiguous="last"),
        Arg.array("key_cache", _CACHE, dtype_of="query", contiguous="last"),
        Arg.array("value_cache", _CACHE, dtype_of="query", contiguous="last"),
        Arg.index("block_tables", "[num_seqs, max_blocks_per_seq]"),
        Arg.index("seq_lens", "[num_seqs]", doc="each sequence's context length, its new tokens included"),
        Arg.out(),
        Arg.hint("max_seq_len", doc="an upper bound on seq_lens (sizes device work without a read)"),
        Arg.index("query_start_loc", "[num_seqs + 1]", required=False,
                  doc="cumulative new-token counts (None: one new token per sequence)"),
        Arg.hint("max_query_len", doc="an upper bound on the new tokens of any sequence"),
    )
    #: scale, window, softcap, sinks, alibi_slopes: one AttentionOptions value (appended to ``args``).
    options = ATTENTION_OPTIONS
    output = Output("[num_tokens, num_heads, head_size]", dtype_of="query")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["query"])),
        Feature("head_size", "head_sizes", lambda args: int(args["query"].shape[2])),
        Feature("block_size", "block_sizes", lambda args: int(args["key_cache"].shape[2])),
        Feature("variant", "variants", variants, many=True,
                doc=", ".join(["prefill", *(variant for _, variant in ATTENTION_OPTIONS.variants), "strided_cache"])),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        num_heads, num_kv_heads = sizes["num_heads"], sizes["num_kv_heads"]
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise fail("key_cache", f"num_kv_heads dividing num_heads={num_heads} in dimension 1",
                       f"num_kv_heads={num_kv_heads}")
        if sizes["block_size"] == 0:
            raise fail("key_cache", "block_size >= 1 in dimension 2", f"shape {tuple(args['key_cache'].shape)}")
        check_disjoint("key_cache", args["key_cache"], "value_cache", args["value_cache"])
        qsl = args.get("query_start_loc")
        if qsl is None and sizes["num_tokens"] != sizes["num_seqs"]:
            raise fail("query", f"num_seqs={sizes['num_seqs']} rows (one new token per sequence without "
                       "query_start_loc)", f"shape {tuple(args['query'].shape)}")
        indices = (args["block_tables"], args["seq_lens"]) + (() if qsl is None else (qsl,))
        if sizes["num_seqs"] and host_index_checks(*indices):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Lengths in ``[0, min(capacity, max_seq_len)]``, used table entries in ``[0, num_blocks)``, and
        ``query_start_loc`` from 0 to ``num_tokens`` without decreasing, each ``q_len`` at most its sequence's
        length and ``max_query_len`` (host arrays; skipped where the last call's that passed held the same
        values, :mod:`~hal_core.ops._index_memo`)."""
        num_blocks, _, block_size, _ = args["key_cache"].shape
        seq_lens, tables = np.asarray(args["seq_lens"]), np.asarray(args["block_tables"])
        qsl = args.get("query_start_loc")
        starts = None if qsl is None else np.asarray(qsl)
        num_tokens, max_seq_len, max_query_len = args["query"].shape[0], args.get("max_seq_len"), \
            args.get("max_query_len")
        key = _PASSED.key((num_blocks, block_size, num_tokens, max_seq_len, max_query_len), tables, seq_lens, starts)
        if _PASSED.passed(key):
            return  # the same values passed on the last call (another layer of the step)
        check_block_tables(tables, seq_lens, num_blocks, block_size, max_seq_len)
        if starts is not None:
            check_query_start_loc(starts, seq_lens, num_tokens, max_query_len)
        _PASSED.keep(key)

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:b<pow2 seqs>:ctx<pow2 longest context>`` (the table's capacity on device arrays); prefill
        calls add ``:q<pow2 max_query_len>``."""
        seqs = args["seq_lens"].shape[0]
        found = f"{dtype_name(args['query'])}:b{pow2(seqs)}:ctx{pow2(_context(args))}"
        if is_prefill(args):
            found += f":q{pow2(args.get('max_query_len') or args['query'].shape[0])}"
        return found

    def flops(self, args: Mapping[str, Any]) -> int:
        """q.k and p.v (two FMAs per element) plus ~5 flops of softmax per (token, attended key, head)."""
        num_heads, head_size = args["query"].shape[1:]
        return _attended_pairs(args) * num_heads * (4 * head_size + 5)

    def nbytes(self, args: Mapping[str, Any]) -> int:
        """K and V rows read once per KV head (the keys some new token of the sequence attends), plus query
        and output."""
        q, kc = args["query"], args["key_cache"]
        _, num_kv_heads, _, head_size = kc.shape
        item = q.dtype.itemsize
        kv = 2 * _read_keys(args) * num_kv_heads * head_size * item
        return kv + 2 * int(np.prod(q.shape)) * item

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        return reference(args, ATTENTION_OPTIONS.value_of(args))


def check_query_start_loc(qsl: np.ndarray, seq_lens: np.ndarray, num_tokens: int, max_query_len: int | None) -> None:
    """Host ``query_start_loc``: starts at 0, never decreases, ends at ``num_tokens``; each ``q_len`` at most its
    ``seq_len`` and ``max_query_len``. The first offender is named."""
    if qsl.size <= SMALL_INDEX_ARRAY and _valid_starts(qsl.tolist(), seq_lens.tolist(), num_tokens, max_query_len):
        return  # a step's few sequences, as Python ints: the common, valid case without numpy's small-array costs
    starts = qsl.astype(np.int64)
    if starts[0] != 0:
        raise fail("query_start_loc", "query_start_loc[0] = 0", f"query_start_loc[0] = {int(starts[0])}")
    q_lens = np.diff(starts)
    if (q_lens < 0).any():
        s = int(np.flatnonzero(q_lens < 0)[0])
        raise fail("query_start_loc", "non-decreasing offsets",
                   f"query_start_loc[{s}] = {int(starts[s])} > query_start_loc[{s + 1}] = {int(starts[s + 1])}")
    if starts[-1] != num_tokens:
        raise fail("query_start_loc", f"a last entry equal to num_tokens = {num_tokens} (query's rows)",
                   f"query_start_loc[-1] = {int(starts[-1])}")
    longer = q_lens > seq_lens
    if longer.any():
        s = int(np.flatnonzero(longer)[0])
        raise ArgumentError(f"argument 'query_start_loc': sequence {s} has {int(q_lens[s])} new tokens but "
                            f"seq_lens[{s}] = {int(seq_lens[s])}; seq_lens must count the new tokens too")
    if max_query_len is not None and q_lens.size and int(q_lens.max()) > max_query_len:
        s = int(np.argmax(q_lens))
        raise fail("query_start_loc", f"new tokens per sequence <= max_query_len = {max_query_len}",
                   f"{int(q_lens[s])} for sequence {s}")


def _valid_starts(starts: list[int], lens: list[int], num_tokens: int, max_query_len: int | None) -> bool:
    """Whether :func:`check_query_start_loc` passes ``query_start_loc`` given as a list (False: it names why)."""
    if not starts or starts[0] != 0 or starts[-1] != num_tokens:
        return False
    longest = 0
    for start, stop, length in zip(starts, starts[1:], lens, strict=False):
        q_len = stop - start
        if q_len < 0 or q_len > length:
            return False
        longest = max(longest, q_len)
    return max_query_len is None or longest <= max_query_len


def _host(array: Any) -> np.ndarray:
    """A host view of a small index array (device arrays are read back: bench and planning only)."""
    if device_of(array)[0] == "cpu":
        return np.asarray(array)
    return np.asarray(array.get() if hasattr(array, "get") else array)


def _query_lens(args: Mapping[str, Any]) -> np.ndarray:
    qsl = args.get("query_start_loc")
    if qsl is None:
        return np.ones(args["seq_lens"].shape[0], dtype=np.int64)
    return np.diff(_host(qsl).astype(np.int64))


def _attended_pairs(args: Mapping[str, Any]) -> int:
    """(new token, attended key) pairs of the whole call."""
    lens = _host(args["seq_lens"]).astype(np.int64)
    if not lens.size:
        return 0
    q_lens = np.minimum(_query_lens(args), lens)
    window = args.get("window")
    if args.get("query_start_loc") is None:
        return int((np.minimum(lens, window) if window else lens).sum())
    total = 0
    for length, q_len in zip(lens.tolist(), q_lens.tolist(), strict=True):
        positions = np.arange(length - q_len, length) + 1  # keys visible to each new token, causal
        total += int((np.minimum(positions, window) if window else positions).sum())
    return total


def _read_keys(args: Mapping[str, Any]) -> int:
    """Key (and value) rows some new token attends, per KV head: each read once."""
    lens = _host(args["seq_lens"]).astype(np.int64)
    if not lens.size:
        return 0
    window = args.get("window")
    if not window:
        return int(lens.sum())
    q_lens = np.minimum(_query_lens(args), lens)
    return int(np.minimum(lens, window + q_lens - 1).sum())


def _context(args: Mapping[str, Any]) -> int:
    seq_lens = args["seq_lens"]
    if isinstance(seq_lens, np.ndarray) and seq_lens.size:
        return int(seq_lens.max())
    return int(args["block_tables"].shape[1]) * int(args["key_cache"].shape[2])


#: Query rows the reference computes at once (bounds its float64 score matrix).
_REFERENCE_ROWS = 256


def reference(args: Mapping[str, Any], options: AttentionOptions) -> np.ndarray:
    """The float64 result of :mod:`the module's formula <hal_core.ops.paged_attention>` for host ``args`` with the
    layer's ``options``."""
    q = np.asarray(args["query"]).astype(np.float64)
    kc, vc = np.asarray(args["key_cache"]), np.asarray(args["value_cache"])
    tables, lens = np.asarray(args["block_tables"]), np.asarray(args["seq_lens"]).astype(np.int64)
    num_heads = q.shape[1]
    group = num_heads // kc.shape[1]
    block_size = kc.shape[2]
    qsl = args.get("query_start_loc")
    starts = np.arange(lens.size + 1) if qsl is None else np.asarray(qsl).astype(np.int64)
    window, softcap, scale = options.window, options.softcap, options.scale
    sinks = None if options.sinks is None else np.asarray(options.sinks).astype(np.float64)
    slopes = None if options.alibi_slopes is None else np.asarray(options.alibi_slopes).astype(np.float64)
    out = np.zeros(q.shape, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs propagate (module docs)
        for s in range(lens.size):
            first, end, length = int(starts[s]), int(starts[s + 1]), int(lens[s])
            if end == first or length == 0:
                continue
            t = np.arange(length)
            blocks = tables[s, t // block_size]
            keys = np.repeat(kc[blocks, :, t % block_size].astype(np.float64), group, axis=1)  # [L, heads, d]
            values = np.repeat(vc[blocks, :, t % block_size].astype(np.float64), group, axis=1)
            for lo in range(first, end, _REFERENCE_ROWS):
                hi = min(end, lo + _REFERENCE_ROWS)
                positions = length - (end - first) + np.arange(lo - first, hi - first)  # [rows]
                scores = np.einsum("ihd,lhd->hil", q[lo:hi], keys) * scale  # [heads, rows, L]
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                if slopes is not None:
                    scores += slopes[:, None, None] * (t[None, None, :] - positions[None, :, None])
                visible = t[None, :] <= positions[:, None]
                if window is not None:
                    visible &= t[None, :] > positions[:, None] - window
                scores = np.where(visible[None], scores, -np.inf)
                top = scores.max(axis=2)
                if sinks is not None:
                    top = np.maximum(top, sinks[:, None])
                p = np.exp(scores - top[:, :, None])
                denominator = p.sum(axis=2)
                if sinks is not None:
                    denominator += np.exp(sinks[:, None] - top)
                out[lo:hi] = np.einsum("hil,lhd->ihd", p / denominator[:, :, None], values)
    return out


PagedAttention.bench = PAGED_ATTENTION_BENCH

register_op(PagedAttention())
