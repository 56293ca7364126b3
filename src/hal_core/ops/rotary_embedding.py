"""``rotary_embedding``: rotary position embedding applied in place to the query and key (vLLM's op).

``positions`` ``[num_tokens]`` (int32 or int64) picks each token's row of ``cos_sin_cache``
``[max_position, rotary_dim]`` float32, whose first ``rotary_dim / 2`` columns hold the cosines and the
second half the sines (:mod:`hal_core.rope` builds it for a model's configuration). ``query``
``[num_tokens, num_heads, head_size]`` and ``key`` ``[num_tokens, num_kv_heads, head_size]`` (fp32, fp16 or
bf16, one dtype; ``key`` optional: None rotates the query alone) are rotated in place, every head of a token
by that token's angles. With ``c, s`` the row's ``i``-th cosine and sine, the pair ``(x1, x2)`` of a head
becomes ``(x1 * c - x2 * s, x2 * c + x1 * s)``, where the pairs are

- ``style='neox'`` (the default; Llama, Qwen and Mistral in transformers, its ``rotate_half``):
  ``(x[i], x[i + rotary_dim / 2])``;
- ``style='gptj'`` (interleaved): ``(x[2 i], x[2 i + 1])``.

``rotary_dim`` comes from the table: even, at most ``head_size``; dimensions past it are left as they are
(partial rotary, e.g. Phi and GPT-NeoX). The arithmetic is float32 (the result rounded once to the dtype); a
NaN in a pair gives NaN in the pair's rotated values.

``query`` and ``key`` may be strided views whose last dimension is contiguous (the slices of a fused QKV
projection); they must be writable and share no element. Values of a host ``positions`` are checked on the
host (``HAL_CHECK_INDICES``): each in ``[0, max_position)``, before anything is written. A device
``positions`` is checked by the kernel, which leaves a token whose position is out of range as it is and
reports ``positions`` through the device error flag (:func:`hal_core.check_errors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..arrays import dtype_name, numpy_dtype
from ..rope import rope_cos_sin_cache
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import SMALL_INDEX_ARRAY, check_writable, fail, host_index_checks
from ._declare import Arg, BenchCases, Feature
from ._inputs import uniform
from ._overlap import check_views_disjoint
from ._spec import OpSpec
from .paged_attention import attention_dtypes

__all__ = ["ROTARY_STYLES", "RotaryEmbedding", "rotary_embedding_inputs", "rotary_pairs"]

#: The pairings of rotated dimensions: halves (``neox``, the default) or adjacent pairs (``gptj``).
ROTARY_STYLES = ("neox", "gptj")


def rotary_pairs(rotary_dim: int, style: str | None) -> tuple[slice, slice]:
    """The index sets of the pairs' first and second members within a head's first ``rotary_dim`` values."""
    half = rotary_dim // 2
    if style == "gptj":
        return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    return slice(0, half), slice(half, rotary_dim)


class RotaryEmbedding(OpSpec):
    """Rotate the query and key heads in place by each token's position (cos/sin table, NeoX or GPT-J pairs)."""

    name = "rotary_embedding"
    args = (
        Arg.index("positions", "[num_tokens]", dtypes=("int32", "int64"),
                  doc="each token's row of cos_sin_cache"),
        Arg.array("query", "[num_tokens, num_heads, head_size]", dtypes=attention_dtypes, contiguous="last",
                  mutated=True),
        Arg.array("cos_sin_cache", "[max_position, rotary_dim]", dtypes=("fp32",),
                  doc="cosines then sines per position (hal_core.rope)"),
        Arg.array("key", "[num_tokens, num_kv_heads, head_size]", dtype_of="query", contiguous="last",
                  mutated=True, required=False, doc="rotated like the query; None rotates the query alone"),
        Arg.choice("style", ROTARY_STYLES, doc="'neox' (halves, the default) or 'gptj' (adjacent pairs)"),
    )
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["query"])),
        Feature("head_size", "head_sizes", lambda args: int(args["query"].shape[2])),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        rotary_dim, head_size = sizes["rotary_dim"], sizes["head_size"]
        if rotary_dim % 2 or rotary_dim < 2 or rotary_dim > head_size:
            raise fail("cos_sin_cache", f"an even rotary_dim in [2, head_size = {head_size}] columns",
                       f"shape {tuple(args['cos_sin_cache'].shape)}")
        if sizes["max_position"] < 1 and sizes["num_tokens"]:
            raise fail("cos_sin_cache", "at least one position row", f"shape {tuple(args['cos_sin_cache'].shape)}")
        check_writable("query", args["query"])
        if args.get("key") is not None:
            check_writable("key", args["key"])
            check_views_disjoint("query", args["query"], "key", args["key"])
        if sizes["num_tokens"] and host_index_checks(args["positions"]):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Every position in ``[0, max_position)`` (a host ``positions``)."""
        positions = np.asarray(args["positions"])
        limit = int(args["cos_sin_cache"].shape[0])
        if positions.size <= SMALL_INDEX_ARRAY:
            values = positions.tolist()
            if not values or (min(values) >= 0 and max(values) < limit):
                return
        elif int(positions.min()) >= 0 and int(positions.max()) < limit:
            return
        i = int(np.flatnonzero((positions < 0) | (positions >= limit))[0])
        raise fail("positions", f"positions in [0, max_position = {limit}) (the rows of cos_sin_cache)",
                   f"positions[{i}] = {int(positions[i])}")

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        return 0 in args["query"].shape[:2] and (args.get("key") is None or 0 in args["key"].shape[:2])

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:t<pow2 tokens>``."""
        return f"{dtype_name(args['query'])}:t{pow2(args['query'].shape[0])}"

    def _rows(self, args: Mapping[str, Any]) -> int:
        """Head rows rotated: tokens times (query heads + key heads)."""
        query, key = args["query"], args.get("key")
        return int(query.shape[0]) * (int(query.shape[1]) + (int(key.shape[1]) if key is not None else 0))

    def flops(self, args: Mapping[str, Any]) -> int:
        """Six per rotated pair (four products, two sums)."""
        return 3 * self._rows(args) * int(args["cos_sin_cache"].shape[1])

    def nbytes(self, args: Mapping[str, Any]) -> int:
        """The rotated part of each head row read and written, and each token's table row read."""
        rotary_dim, query = int(args["cos_sin_cache"].shape[1]), args["query"]
        tokens = int(query.shape[0])
        return (2 * self._rows(args) * rotary_dim * query.dtype.itemsize + tokens * rotary_dim * 4
                + tokens * args["positions"].dtype.itemsize)

    def reference(self, args: Mapping[str, Any]) -> tuple[np.ndarray, ...]:
        """The new query (and key, when given) in float64."""
        table = np.asarray(args["cos_sin_cache"]).astype(np.float64)
        rotary_dim = table.shape[1]
        rows = table[np.asarray(args["positions"]).astype(np.int64)]
        cos, sin = rows[:, None, : rotary_dim // 2], rows[:, None, rotary_dim // 2:]
        first, second = rotary_pairs(rotary_dim, args.get("style"))
        results = []
        for name in ("query", "key"):
            if args.get(name) is None:
                continue
            x = np.asarray(args[name]).astype(np.float64)
            x1, x2 = x[..., first].copy(), x[..., second].copy()
            x[..., first] = x1 * cos - x2 * sin
            x[..., second] = x2 * cos + x1 * sin
            results.append(x)
        return tuple(results)


def rotary_embedding_inputs(rng: np.random.Generator, *, num_tokens: int, num_heads: int, num_kv_heads: int,
                            head_size: int, dtype: str, rotary_dim: int | None = None, max_position: int = 64,
                            with_key: bool = True, poison: bool = True) -> dict[str, Any]:
    """Host arguments: random positions, a table of real angles whose unused rows hold NaN (``poison``), and
    query/key values in [-1, 1)."""
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    positions = rng.integers(0, max_position, num_tokens)
    table = rope_cos_sin_cache(rotary_dim, max_position)  # theta 10000, unscaled
    if poison:
        unused = np.ones(max_position, dtype=bool)
        unused[positions] = False
        table[unused] = np.nan
    np_dtype = numpy_dtype(dtype)
    args: dict[str, Any] = {
        "positions": positions.astype(np.int32 if rng.random() < 0.5 else np.int64),
        "query": (2 * rng.random((num_tokens, num_heads, head_size)) - 1).astype(np_dtype),
        "cos_sin_cache": table,
    }
    if with_key:
        args["key"] = (2 * rng.random((num_tokens, num_kv_heads, head_size)) - 1).astype(np_dtype)
    return args


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    rotary_dim = int(p["rotary"]) or p["head"]
    tokens = p["tokens"]
    qkv = uniform(rng, (tokens, p["heads"] + 2 * p["kv_heads"], p["head"]), p["dtype"])  # a fused projection
    args = rotary_embedding_inputs(rng, num_tokens=0, num_heads=1, num_kv_heads=1, head_size=p["head"],
                                   dtype=p["dtype"], rotary_dim=rotary_dim, max_position=p["max_pos"], poison=False)
    return {"positions": rng.integers(0, p["max_pos"], tokens), "query": qkv[:, : p["heads"]],
            "cos_sin_cache": args["cos_sin_cache"], "key": qkv[:, p["heads"]: p["heads"] + p["kv_heads"]]}


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return rotary_embedding_inputs(rng, num_tokens=p["tokens"], num_heads=p["heads"], num_kv_heads=p["kv_heads"],
                                   head_size=p["head"], dtype=p["dtype"], rotary_dim=int(p["rotary"]) or p["head"],
                                   max_position=p["max_pos"])


def _check_case(p: Mapping[str, Any]) -> str | None:
    rotary = int(p["rotary"])
    if rotary and (rotary % 2 or rotary > p["head"]):
        return f"rotary must be even and at most head={p['head']}"
    return None


RotaryEmbedding.bench = BenchCases(
    params={"tokens": 8, "heads": 32, "kv_heads": 8, "head": 128, "rotary": 0, "max_pos": 4096, "dtype": "bf16"},
    aliases={"num_tokens": "tokens", "num_heads": "heads", "num_kv_heads": "kv_heads", "head_size": "head",
             "rotary_dim": "rotary", "max_position": "max_pos"},
    may_be_zero=frozenset({"rotary"}),
    label=lambda p: (f"rotary_embedding {p['dtype']} {p['tokens']} tok h{p['heads']}/{p['kv_heads']} d{p['head']}"
                     + (f" r{p['rotary']}" if p["rotary"] else "")),
    check=_check_case,
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [{"tokens": t, "dtype": dt} for t in (1, 8) for dt in ("fp32", "bf16")],
        "prefill": lambda: [{"tokens": 512, "dtype": dt} for dt in ("fp32", "bf16")],
        "step": lambda: [{"tokens": t, "heads": h, "kv_heads": kv, "head": 128, "dtype": dt}
                         for t in (1, 8, 512) for h, kv in ((16, 4), (32, 32)) for dt in ("fp32", "bf16")],
    },
    explain=({"dtype": "bf16", "tokens": 8, "heads": 32, "kv_heads": 8, "head": 128, "max_pos": 64},
             {"dtype": "fp16", "tokens": 1, "heads": 32, "kv_heads": 32, "head": 80, "rotary": 32, "max_pos": 64}),
    test_inputs=_test_inputs,
    tiny={"tokens": 1, "heads": 4, "kv_heads": 1, "head": 64, "max_pos": 16, "dtype": "fp32"},
)

register_op(RotaryEmbedding())
