"""``paged_attention``'s inputs: benchmark cases (fast, realistic) and test cases (poisoned where the op must not read).

:func:`paged_attention_inputs` builds host arguments for given context and new-token lengths;
:data:`PAGED_ATTENTION_BENCH` holds the ``hal bench`` / ``hal info --explain`` cases. The options a case
uses (its sliding ``window``) are built as one :class:`~hal_core.ops.AttentionOptions` and spread into the
arguments by name, so a case takes whatever the option group declares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ._declare import BenchCases
from ._inputs import distinct_blocks, poison_unused, uniform
from .paged_attention_options import ATTENTION_OPTIONS, AttentionOptions

__all__ = ["PAGED_ATTENTION_BENCH", "attention_dtypes", "paged_attention_inputs"]

#: dtypes paged_attention accepts for query and caches.
attention_dtypes = ("fp32", "fp16", "bf16")


def _options(p: Mapping[str, Any]) -> dict[str, Any]:
    """The option arguments of a case: its softmax scale and window, through :class:`AttentionOptions`."""
    options = AttentionOptions(scale=float(1.0 / np.sqrt(p["head"])), window=p["window"] or None)
    return {name: value for name, value in ATTENTION_OPTIONS.flat(options).items() if value is not None}


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
        **_options(p),
    }
    if q_lens is not None:
        args["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        args["max_query_len"] = max(q_lens)
    return args


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    lens, q_lens = _bench_lens(p)
    args = paged_attention_inputs(rng, seq_lens=lens, num_heads=p["heads"], num_kv_heads=p["kv_heads"],
                                  head_size=p["head"], block_size=p["block"], dtype=p["dtype"], query_lens=q_lens)
    return {**args, **_options(p)}


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
