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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ArgumentError
from ..arrays import device_of, dtype_name, is_c_contiguous, numpy_dtype
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import check_block_tables, check_disjoint, fail, host_index_checks
from ._declare import Arg, BenchCases, Feature, Output
from ._inputs import distinct_blocks, poison_unused, uniform
from ._spec import OpSpec

__all__ = ["PagedAttention", "attention_dtypes", "is_prefill", "paged_attention_inputs", "variants"]

#: dtypes paged_attention accepts for query and caches.
attention_dtypes = ("fp32", "fp16", "bf16")
_CACHE = "[num_blocks, num_kv_heads, block_size, head_size]"


def variants(args: Mapping[str, Any]) -> frozenset[str]:
    """The optional behaviours a call uses (what a backend's coverage must declare to claim it)."""
    found = set()
    if is_prefill(args):
        found.add("prefill")
    for name in ("window", "softcap", "sinks", "alibi_slopes"):
        if args.get(name) is not None:
            found.add("alibi" if name == "alibi_slopes" else name)
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
        Arg.scalar("scale", float, doc="the softmax scale (usually head_size ** -0.5)"),
        Arg.out(),
        Arg.hint("max_seq_len", doc="an upper bound on seq_lens (sizes device work without a read)"),
        Arg.index("query_start_loc", "[num_seqs + 1]", required=False,
                  doc="cumulative new-token counts (None: one new token per sequence)"),
        Arg.hint("max_query_len", doc="an upper bound on the new tokens of any sequence"),
        Arg.scalar("window", int, required=False, minimum=1,
                   doc="sliding window: a token attends only the last `window` keys up to itself"),
        Arg.scalar("softcap", float, required=False, minimum=0, exclusive=True,
                   doc="logit softcap: scores become softcap * tanh(score / softcap)"),
        Arg.array("sinks", "[num_heads]", dtypes=("fp32",), required=False,
                  doc="one extra logit per head in the softmax denominator"),
        Arg.array("alibi_slopes", "[num_heads]", dtypes=("fp32",), required=False,
                  doc="ALiBi: slope[h] * (t - p) added to the score of key t at position p"),
    )
    output = Output("[num_tokens, num_heads, head_size]", dtype_of="query")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["query"])),
        Feature("head_size", "head_sizes", lambda args: int(args["query"].shape[2])),
        Feature("block_size", "block_sizes", lambda args: int(args["key_cache"].shape[2])),
        Feature("variant", "variants", variants, many=True,
                doc="prefill, window, softcap, sinks, alibi, strided_cache"),
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
        length and ``max_query_len`` (host arrays)."""
        num_blocks, _, block_size, _ = args["key_cache"].shape
        seq_lens = np.asarray(args["seq_lens"])
        check_block_tables(np.asarray(args["block_tables"]), seq_lens, num_blocks, block_size,
                           args.get("max_seq_len"))
        qsl = args.get("query_start_loc")
        if qsl is not None:
            check_query_start_loc(np.asarray(qsl), seq_lens, args["query"].shape[0], args.get("max_query_len"))

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
        return reference(args)


def check_query_start_loc(qsl: np.ndarray, seq_lens: np.ndarray, num_tokens: int, max_query_len: int | None) -> None:
    """Host ``query_start_loc``: starts at 0, never decreases, ends at ``num_tokens``; each ``q_len`` at most its
    ``seq_len`` and ``max_query_len``. The first offender is named."""
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


def reference(args: Mapping[str, Any]) -> np.ndarray:
    """The float64 result of :mod:`the module's formula <hal_core.ops.paged_attention>` for host ``args``."""
    q = np.asarray(args["query"]).astype(np.float64)
    kc, vc = np.asarray(args["key_cache"]), np.asarray(args["value_cache"])
    tables, lens = np.asarray(args["block_tables"]), np.asarray(args["seq_lens"]).astype(np.int64)
    num_heads = q.shape[1]
    group = num_heads // kc.shape[1]
    block_size = kc.shape[2]
    qsl = args.get("query_start_loc")
    starts = np.arange(lens.size + 1) if qsl is None else np.asarray(qsl).astype(np.int64)
    window, softcap, scale = args.get("window"), args.get("softcap"), args["scale"]
    sinks = None if args.get("sinks") is None else np.asarray(args["sinks"]).astype(np.float64)
    slopes = None if args.get("alibi_slopes") is None else np.asarray(args["alibi_slopes"]).astype(np.float64)
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


# -- inputs: benchmark cases (fast) and test cases (poisoned) --------------------------------------------


def paged_attention_inputs(
    rng: np.random.Generator,
    *,
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: str,
    spare_blocks: int = 2,
    query_lens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Host arguments for these context lengths; with ``query_lens``, that many new tokens per sequence
    (packed, with ``query_start_loc`` and ``max_query_len``), else one each (decode).

    Block tables assign distinct blocks in random order with garbage past each sequence's last block;
    every cache slot no sequence uses is NaN, so a backend that reads one fails.
    """
    lens = np.asarray(seq_lens, dtype=np.int32).reshape(-1)
    tables, num_blocks, used = distinct_blocks(rng, lens, block_size, spare_blocks, garbage=True)
    np_dtype = numpy_dtype(dtype)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    value_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    poison_unused((key_cache, value_cache), used)
    args: dict[str, Any] = {"block_tables": tables, "seq_lens": lens, "scale": float(1.0 / np.sqrt(head_size))}
    num_tokens = lens.size
    if query_lens is not None:
        q_lens = np.asarray(query_lens, dtype=np.int32).reshape(-1)
        if q_lens.shape != lens.shape or (q_lens > lens).any() or (q_lens < 0).any():
            raise ValueError(f"query_lens {q_lens.tolist()} must pair with seq_lens {lens.tolist()} (0 <= q <= len)")
        args["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        args["max_query_len"] = max(1, int(q_lens.max(initial=0)))
        num_tokens = int(q_lens.sum())
    args.update(query=rng.standard_normal((num_tokens, num_heads, head_size)).astype(np_dtype),
                key_cache=key_cache, value_cache=value_cache)
    return args


def _bench_lens(p: Mapping[str, Any]) -> tuple[list[int], list[int] | None]:
    """Context and new-token lengths of a case: ``seqs`` decodes at ``ctx``, plus ``prompts`` prompt chunks of
    ``q`` new tokens at contexts spread over ``[q, ctx]``."""
    lens, q_lens = [p["ctx"]] * p["seqs"], [1] * p["seqs"]
    prompts = p["prompts"]
    for i in range(prompts):
        q_lens.append(p["q"])
        lens.append(p["q"] + (p["ctx"] - p["q"]) * i // max(1, prompts - 1) if prompts > 1 else p["ctx"])
    return lens, (q_lens if prompts else None)


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    lens, q_lens = _bench_lens(p)
    block = p["block"]
    tables, num_blocks, _ = distinct_blocks(rng, np.asarray(lens), block, 0, garbage=False)
    shape = (num_blocks, p["kv_heads"], block, p["head"])
    num_tokens = len(lens) if q_lens is None else sum(q_lens)
    args: dict[str, Any] = {
        "query": uniform(rng, (num_tokens, p["heads"], p["head"]), p["dtype"]),
        "key_cache": uniform(rng, shape, p["dtype"]),
        "value_cache": uniform(rng, shape, p["dtype"]),
        "block_tables": tables,
        "seq_lens": np.asarray(lens, dtype=np.int32),
        "scale": float(1.0 / np.sqrt(p["head"])),
    }
    if q_lens is not None:
        args["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        args["max_query_len"] = max(q_lens)
    if p["window"]:
        args["window"] = p["window"]
    return args


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    lens, q_lens = _bench_lens(p)
    args = paged_attention_inputs(rng, seq_lens=lens, num_heads=p["heads"], num_kv_heads=p["kv_heads"],
                                  head_size=p["head"], block_size=p["block"], dtype=p["dtype"], query_lens=q_lens)
    if p["window"]:
        args["window"] = p["window"]
    return args


def _label(p: Mapping[str, Any]) -> str:
    shape = f"{p['seqs']}x{p['ctx']}" if not p["prompts"] else (
        f"{p['prompts']}x{p['q']} prefill" + (f" + {p['seqs']}x{p['ctx']}" if p["seqs"] else "")
        + ("" if p["q"] == p["ctx"] else f" ctx<={p['ctx']}"))
    window = f" w{p['window']}" if p["window"] else ""
    return f"paged_attention {p['dtype']} {shape} h{p['heads']}/{p['kv_heads']} d{p['head']}{window}"


def _check_case(p: Mapping[str, Any]) -> str | None:
    if p["heads"] % p["kv_heads"]:
        return f"kv_heads={p['kv_heads']} must divide heads={p['heads']}"
    if not p["seqs"] and not p["prompts"]:
        return "seqs (decodes) and prompts cannot both be 0"
    if p["prompts"] and not 1 <= p["q"] <= p["ctx"]:
        return f"q={p['q']} (new tokens per prompt) must be in [1, ctx={p['ctx']}]"
    return None


def _case(**values: Any) -> dict[str, Any]:
    return values


def _decode_cases() -> list[dict[str, Any]]:
    cases = [_case(seqs=s, ctx=c, dtype=dt) for dt in attention_dtypes for s, c in ((8, 512), (32, 4096), (1, 32768))]
    return cases + [_case(seqs=s, ctx=c, dtype="fp16") for s, c in ((1, 512), (64, 1024), (4, 8192))]


def _prefill_cases() -> list[dict[str, Any]]:
    prompts = [_case(seqs=0, prompts=1, q=4096, ctx=4096, dtype=dt) for dt in attention_dtypes]
    windows = [_case(seqs=0, prompts=1, q=8192, ctx=8192, dtype="fp32", window=w) for w in (0, 1024)]
    return prompts + windows


def _mixed_cases() -> list[dict[str, Any]]:
    return [_case(seqs=60, ctx=2048, prompts=4, q=512, dtype=dt) for dt in ("fp32", "bf16")]


PAGED_ATTENTION_BENCH = BenchCases(
    params={"seqs": 1, "ctx": 512, "heads": 32, "kv_heads": 8, "head": 128, "block": 16, "dtype": "fp16",
            "prompts": 0, "q": 1, "window": 0},
    aliases={"head_size": "head", "block_size": "block", "num_seqs": "seqs", "batch": "seqs", "context": "ctx",
             "seq_len": "ctx", "num_heads": "heads", "num_kv_heads": "kv_heads", "query_len": "q"},
    may_be_zero=frozenset({"seqs", "prompts", "window"}),
    label=_label,
    check=_check_case,
    inputs=_bench_inputs,
    presets={"decode": _decode_cases, "prefill": _prefill_cases, "mixed": _mixed_cases},
    explain=(
        _case(dtype="fp16", head=128, block=16, ctx=512, seqs=4, heads=32, kv_heads=8),
        _case(dtype="bf16", head=64, block=32, ctx=4096, seqs=1, heads=8, kv_heads=1),
        _case(dtype="fp32", head=256, block=8, ctx=33, seqs=2, heads=4, kv_heads=4),
        _case(dtype="fp16", head=128, block=16, ctx=300, seqs=2, prompts=2, q=100, heads=8, kv_heads=2),
    ),
    test_inputs=_test_inputs,
    tiny={"seqs": 1, "ctx": 8, "heads": 4, "kv_heads": 1, "head": 64, "block": 16, "dtype": "fp32"},
)
PagedAttention.bench = PAGED_ATTENTION_BENCH

register_op(PagedAttention())
