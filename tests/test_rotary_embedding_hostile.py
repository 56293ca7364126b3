"""rotary_embedding given hostile input: every bad shape, dtype, layout or value is refused naming the argument,
before anything is written; fused-QKV views that do not overlap are accepted, ones that do are refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.testing.inputs import rotary_embedding_inputs


@pytest.fixture
def cpu() -> Any:
    return hal_core.get_backend("cpu")


def _args() -> dict[str, Any]:
    return rotary_embedding_inputs(np.random.default_rng(21), num_tokens=6, num_heads=4, num_kv_heads=2,
                                   head_size=64, dtype="fp16", max_position=32, poison=False)


def _read_only(a: dict[str, Any]) -> None:
    a["query"].flags.writeable = False


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], Any], type[Exception], str]] = [
    ("positions-2d", lambda a: a.update(positions=a["positions"].reshape(2, 3)), ArgumentError, "positions"),
    ("positions-float", lambda a: a.update(positions=a["positions"].astype(np.float64)), ArgumentTypeError,
     "positions"),
    ("positions-uint8", lambda a: a.update(positions=a["positions"].astype(np.uint8)), ArgumentTypeError,
     "positions"),
    ("positions-short", lambda a: a.update(positions=a["positions"][:5].copy()), ArgumentError, "positions"),
    ("position-huge", lambda a: a.update(positions=np.array([0, 1, 2, 2**40, 3, 4], np.int64)), ArgumentError,
     "positions"),
    ("position-negative", lambda a: a.update(positions=np.array([0, 1, -5, 2, 3, 4], np.int32)), ArgumentError,
     "positions"),
    ("position-at-table-end", lambda a: a.update(positions=np.array([0, 1, 2, 32, 3, 4])), ArgumentError,
     "positions"),
    ("query-list", lambda a: a.update(query=a["query"].tolist()), ArgumentTypeError, "query"),
    ("query-int", lambda a: a.update(query=a["query"].astype(np.int16)), ArgumentTypeError, "query"),
    ("query-read-only", _read_only, ArgumentError, "query"),
    ("query-strided-last-dim", lambda a: a.update(query=np.repeat(a["query"], 2, axis=2)[..., ::2]),
     ArgumentError, "query"),
    ("query-negative-strides", lambda a: a.update(query=a["query"][::-1]), ArgumentError, "query"),
    ("key-other-dtype", lambda a: a.update(key=a["key"].astype(np.float32)), ArgumentTypeError, "key"),
    ("key-rank", lambda a: a.update(key=a["key"][:, 0]), ArgumentError, "key"),
    ("table-fp16", lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].astype(np.float16)), ArgumentTypeError,
     "cos_sin_cache"),
    ("table-float64", lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].astype(np.float64)), ArgumentTypeError,
     "cos_sin_cache"),
    ("table-strided", lambda a: a.update(cos_sin_cache=np.repeat(a["cos_sin_cache"], 2, axis=1)[:, ::2]),
     ArgumentError, "cos_sin_cache"),
    ("table-rank", lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][0]), ArgumentError, "cos_sin_cache"),
    ("table-no-columns", lambda a: a.update(cos_sin_cache=np.zeros((32, 0), np.float32)), ArgumentError,
     "cos_sin_cache"),
    ("table-no-rows", lambda a: a.update(cos_sin_cache=np.zeros((0, 64), np.float32)), ArgumentError,
     "cos_sin_cache"),
    ("style-int", lambda a: a.update(style=1), ArgumentTypeError, "style"),
    ("style-unknown", lambda a: a.update(style="NEOX"), ArgumentError, "style"),
]


@pytest.mark.parametrize(("case", "mutate", "error", "argument"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_input_is_refused_before_any_write(cpu: Any, case: str, mutate: Callable[[dict[str, Any]], Any],
                                                   error: type[Exception], argument: str) -> None:
    """The error names the argument; query and key keep every bit."""
    args = _args()
    args.setdefault("style", None)
    query, key = args["query"], args["key"]
    before_q, before_k = query.copy(), key.copy()
    mutate(args)
    with pytest.raises(error) as info:
        cpu.ops.rotary_embedding(args["positions"], args["query"], args["cos_sin_cache"], key=args["key"],
                                 style=args["style"])
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(query.view(np.uint16), before_q.view(np.uint16))
    np.testing.assert_array_equal(key.view(np.uint16), before_k.view(np.uint16))


@pytest.mark.parametrize("order", ["qkv", "kqv", "kvq"])
def test_disjoint_fused_views_are_accepted(cpu: Any, order: str) -> None:
    """Query and key as slices of one projection, in any order of the three parts, interleaving token by token."""
    args = _args()
    parts = {"q": 4, "k": 2, "v": 2}
    starts = {name: sum(parts[o] for o in order[: order.index(name)]) for name in parts}
    qkv = np.zeros((6, 8, 64), np.float16)
    query = qkv[:, starts["q"]: starts["q"] + 4]
    key = qkv[:, starts["k"]: starts["k"] + 2]
    query[...], key[...] = args["query"], args["key"]
    cpu.ops.rotary_embedding(args["positions"], query, args["cos_sin_cache"], key=key)
    assert not np.array_equal(query, args["query"])
    np.testing.assert_array_equal(qkv[:, starts["v"]: starts["v"] + 2], 0)


@pytest.mark.parametrize(("q_heads", "k_heads"), [((0, 4), (3, 5)), ((2, 6), (0, 3)), ((0, 4), (0, 2))])
def test_overlapping_views_are_refused(cpu: Any, q_heads: tuple[int, int], k_heads: tuple[int, int]) -> None:
    """Query and key sharing heads of one buffer would rotate those twice: refused naming both, nothing written."""
    qkv = np.random.default_rng(3).standard_normal((6, 8, 64)).astype(np.float16)
    before = qkv.copy()
    args = _args()
    with pytest.raises(ArgumentError, match="'query' and 'key' overlap"):
        cpu.ops.rotary_embedding(args["positions"], qkv[:, q_heads[0]: q_heads[1]], args["cos_sin_cache"],
                                 key=qkv[:, k_heads[0]: k_heads[1]])
    np.testing.assert_array_equal(qkv.view(np.uint16), before.view(np.uint16))


def test_views_sharing_no_element_within_one_row_are_accepted(cpu: Any) -> None:
    """Query the even heads and key the odd heads of one buffer: interleaved, never the same element."""
    args = _args()
    buffer = np.zeros((6, 8, 64), np.float16)
    query, key = buffer[:, 0::2], buffer[:, 1:5:2]
    query[...], key[...] = args["query"], args["key"]
    cpu.ops.rotary_embedding(args["positions"], query, args["cos_sin_cache"], key=key)
    np.testing.assert_array_equal(buffer[:, 5::2], 0)
