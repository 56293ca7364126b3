"""The float64 reference of paged_attention against a plain loop written from the op's docs, and its checks.

The loop below is independent of :func:`hal_core.ops.paged_attention.reference`: one new token and one
head at a time, keys gathered one by one through the block table, the softmax written out term by term.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import paged_attention_inputs

SPEC = OPS["paged_attention"]


def loop_reference(args: dict[str, Any]) -> np.ndarray:
    """out[row, h] per the module docs, by loops (slow; small inputs only)."""
    q = args["query"].astype(np.float64)
    kc, vc = args["key_cache"].astype(np.float64), args["value_cache"].astype(np.float64)
    tables, lens = args["block_tables"], args["seq_lens"]
    block = kc.shape[2]
    group = q.shape[1] // kc.shape[1]
    qsl = args.get("query_start_loc")
    starts = list(range(len(lens) + 1)) if qsl is None else [int(v) for v in qsl]
    window, softcap = args.get("window"), args.get("softcap")
    sinks, slopes = args.get("sinks"), args.get("alibi_slopes")
    out = np.zeros(q.shape)
    for s, length in enumerate(int(v) for v in lens):
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            row, p = starts[s] + i, length - q_len + i
            keys = [t for t in range(p + 1) if window is None or t > p - window]
            for h in range(q.shape[1]):
                kvh = h // group
                scores = []
                for t in keys:
                    x = float(args["scale"]) * float(q[row, h] @ kc[tables[s, t // block], kvh, t % block])
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    if slopes is not None:
                        x += float(slopes[h]) * (t - p)
                    scores.append(x)
                top = max(scores + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                for w, t in zip(weights, keys, strict=True):
                    out[row, h] += w / total * vc[tables[s, t // block], kvh, t % block]
    return out


def _inputs(seed: int, lens: list[int], q_lens: list[int] | None, heads: int = 4, kv_heads: int = 2,
            head: int = 16, block: int = 4, dtype: str = "fp32", **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    args = paged_attention_inputs(rng, seq_lens=lens, num_heads=heads, num_kv_heads=kv_heads, head_size=head,
                                  block_size=block, dtype=dtype, query_lens=q_lens)
    for name, value in extra.items():
        if name in ("sinks", "alibi_slopes") and value is True:
            value = (rng.standard_normal(heads) * (2.0 if name == "sinks" else 0.1)).astype(np.float32)
        args[name] = value
    return args


CASES = [  # lens, q_lens, extra
    ([5, 9, 1], None, {}),
    ([5, 9, 1], [5, 3, 1], {}),
    ([7, 12], [2, 12], {"window": 3}),
    ([7, 12], [7, 4], {"softcap": 2.0}),
    ([6, 10], [1, 10], {"sinks": True}),
    ([6, 10], [6, 1], {"alibi_slopes": True}),
    ([11, 4, 0], [6, 4, 0], {"window": 5, "softcap": 3.0, "sinks": True, "alibi_slopes": True}),
]


@pytest.mark.parametrize(("lens", "q_lens", "extra"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reference_matches_the_loop(lens: list[int], q_lens: list[int] | None, extra: dict[str, Any]) -> None:
    seed = 4100 + CASES.index((lens, q_lens, extra))
    print(f"seed={seed}")
    args = _inputs(seed, lens, q_lens, **extra)
    np.testing.assert_allclose(SPEC.reference(args), loop_reference(args), rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), data=st.data())
def test_reference_matches_the_loop_on_random_batches(seed: int, data: st.DataObject) -> None:
    lens = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=4))
    q_lens = [data.draw(st.integers(0, n)) for n in lens]
    extra = {}
    if data.draw(st.booleans()):
        extra["window"] = data.draw(st.integers(1, 8))
    if data.draw(st.booleans()):
        extra["softcap"] = data.draw(st.floats(0.5, 30.0))
    for name in ("sinks", "alibi_slopes"):
        if data.draw(st.booleans()):
            extra[name] = True
    args = _inputs(seed, lens, q_lens, heads=6, kv_heads=3, head=8, block=3, **extra)
    np.testing.assert_allclose(SPEC.reference(args), loop_reference(args), rtol=1e-12, atol=1e-12)


def test_decode_is_the_one_token_case() -> None:
    """Without query_start_loc every sequence has one new token: the same as q_len = 1 everywhere."""
    args = _inputs(9, [5, 9, 3], None, window=4)
    packed = {**args, "query_start_loc": np.arange(4, dtype=np.int32), "max_query_len": 1}
    np.testing.assert_array_equal(SPEC.reference(args), SPEC.reference(packed))


def test_a_sink_only_shrinks_the_weights() -> None:
    """A sink adds probability mass that weights no value: a very negative one changes nothing."""
    args = _inputs(3, [8], [3])
    quiet = {**args, "sinks": np.full(4, -1e4, np.float32)}
    np.testing.assert_allclose(SPEC.reference(quiet), SPEC.reference(args), rtol=1e-12)
    loud = {**args, "sinks": np.full(4, 1e4, np.float32)}
    assert np.abs(SPEC.reference(loud)).max() < 1e-300


def _call(args: dict[str, Any], **changes: Any) -> Any:
    backend = hal_core.get_backend("cpu")
    merged = {**args, **changes}
    return backend.ops.paged_attention(merged.pop("query"), merged.pop("key_cache"), merged.pop("value_cache"),
                                       merged.pop("block_tables"), merged.pop("seq_lens"), **merged)


BAD = [  # change, error, what the message names
    ({"query_start_loc": np.array([1, 3, 6], np.int32)}, ArgumentError, "query_start_loc\\[0\\] = 0"),
    ({"query_start_loc": np.array([0, 4, 3], np.int32)}, ArgumentError, "non-decreasing"),
    ({"query_start_loc": np.array([0, 2, 5], np.int32)}, ArgumentError, "num_tokens = 6"),
    ({"query_start_loc": np.array([0, 3, 6, 6], np.int32)}, ArgumentError, "query_start_loc"),
    ({"query_start_loc": np.array([0, 3, 6], np.int64)}, ArgumentTypeError, "query_start_loc"),
    ({"seq_lens": np.array([2, 9], np.int32)}, ArgumentError, "sequence 0 has 3 new tokens"),
    ({"max_query_len": 2}, ArgumentError, "max_query_len = 2"),
    ({"window": 0}, ArgumentError, "'window'"),
    ({"window": 2.5}, ArgumentTypeError, "'window'"),
    ({"softcap": 0.0}, ArgumentError, "'softcap'"),
    ({"softcap": float("inf")}, ArgumentTypeError, "'softcap'"),
    ({"sinks": np.zeros(3, np.float32)}, ArgumentError, "'sinks'"),
    ({"sinks": np.zeros(4, np.float16)}, ArgumentTypeError, "'sinks'"),
    ({"alibi_slopes": np.zeros((4, 1), np.float32)}, ArgumentError, "'alibi_slopes'"),
]


@pytest.mark.parametrize(("change", "error", "named"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_variable_length_arguments_are_named_before_any_work(change: dict[str, Any], error: type,
                                                                 named: str) -> None:
    args = _inputs(11, [5, 9], [3, 3])
    out = np.full(args["query"].shape, 7.0, np.float32)
    with pytest.raises(error, match=named):
        _call(args, out=out, **change)
    assert (out == 7.0).all()


def test_without_query_start_loc_one_row_per_sequence() -> None:
    args = _inputs(12, [5, 9], [3, 3])
    del args["query_start_loc"], args["max_query_len"]
    with pytest.raises(ArgumentError, match="'query': expected num_seqs=2 rows"):
        _call(args)


def test_strided_caches_and_interleaved_halves() -> None:
    """K/V as the two halves of one [..., 2 * block_size, head] tensor (an engine's layout) are accepted; one
    array overlapping the other is not."""
    args = _inputs(13, [9, 4], [4, 4])
    kc, vc = args["key_cache"], args["value_cache"]
    both = np.concatenate([kc, vc], axis=2)  # [blocks, kv_heads, 2 * block, head]
    k, v = both[:, :, : kc.shape[2]], both[:, :, kc.shape[2]:]
    assert not k.flags.c_contiguous and np.shares_memory(both, k)
    expected = SPEC.reference(args)
    got = _call(args, key_cache=k, value_cache=v)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    shifted = both[:, :, 1: kc.shape[2] + 1]
    with pytest.raises(ArgumentError, match="overlap"):
        _call(args, key_cache=shifted, value_cache=v)
