"""rotary_embedding against the float64 reference: both styles, partial rotary, fused-QKV views, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, rotary_embedding_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES, OP_SETTINGS, seeds

REFERENCE = OPS["rotary_embedding"].reference


def _run(backend: Any, args: dict[str, Any], *, fused: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Call the op on ``backend`` (query and key as slices of one QKV array when ``fused``); the results on the host."""
    if fused:
        query, key = args["query"], args["key"]
        heads, kv_heads = query.shape[1], key.shape[1]
        qkv = np.concatenate([query, key, key], axis=1)  # [tokens, q + k + v heads, head_size]
        dev_qkv = backend.asarray(qkv)
        dev = to_backend(backend, "rotary_embedding", dict(args, query=None, key=None))
        dev["query"], dev["key"] = dev_qkv[:, :heads], dev_qkv[:, heads: heads + kv_heads]
    else:
        dev = to_backend(backend, "rotary_embedding", args)
    result = backend.ops.rotary_embedding(dev["positions"], dev["query"], dev["cos_sin_cache"], key=dev.get("key"),
                                          style=args.get("style"))
    assert result is None
    if fused:
        after = backend.to_numpy(dev_qkv)
        np.testing.assert_array_equal(after[:, heads + kv_heads:].view(np.uint8), qkv[:, heads + kv_heads:].view(
            np.uint8), err_msg="the value slice of the fused projection changed")
        return after[:, :heads], after[:, heads: heads + kv_heads]
    key = dev.get("key")
    return backend.to_numpy(dev["query"]), None if key is None else backend.to_numpy(key)


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    head_size=st.sampled_from((64, 80, 96, 128, 256)),
    rotary_fraction=st.sampled_from((1.0, 0.5, 0.25)),
    style=st.sampled_from((None, "neox", "gptj")),
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.integers(1, 4),
    group=st.sampled_from((1, 4)),
    fused=st.booleans(),
)
def test_rotary_embedding_matches_reference(hal_backend: Any, seed: int, dtype: str, head_size: int,
                                            rotary_fraction: float, style: str | None, num_tokens: int,
                                            num_kv_heads: int, group: int, fused: bool) -> None:
    """Query and key rotate by their positions' rows; the dimensions past rotary_dim and unused rows stay untouched."""
    rng = np.random.default_rng(seed)
    rotary_dim = 2 * max(1, int(head_size * rotary_fraction) // 2)
    args = rotary_embedding_inputs(rng, num_tokens=num_tokens, num_heads=num_kv_heads * group,
                                   num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                                   rotary_dim=rotary_dim, max_position=int(rng.integers(1, 200)))
    args["style"] = style
    want_q, want_k = REFERENCE(args)
    got_q, got_k = _run(hal_backend, args, fused=fused)
    assert got_k is not None
    assert_close(got_q, want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(got_k, want_k, kind="rotary", dtype=dtype, what="key")
    np.testing.assert_array_equal(got_q[..., rotary_dim:].view(np.uint8), args["query"][..., rotary_dim:].view(
        np.uint8), err_msg="query dimensions past rotary_dim changed")


def test_rotary_embedding_query_alone(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """key=None rotates the query and nothing else."""
    args = rotary_embedding_inputs(hal_rng, num_tokens=5, num_heads=3, num_kv_heads=1, head_size=64, dtype="bf16",
                                   with_key=False)
    (want_q,) = REFERENCE(args)
    got_q, got_k = _run(hal_backend, args)
    assert got_k is None
    assert_close(got_q, want_q, kind="rotary", dtype="bf16", what="query")


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_embedding_nan_stays_in_its_pair(hal_backend: Any, hal_rng: np.random.Generator, style: str) -> None:
    """A NaN in the query makes its pair NaN (both rotated values) and nothing else."""
    args = rotary_embedding_inputs(hal_rng, num_tokens=3, num_heads=2, num_kv_heads=1, head_size=64, dtype="fp32")
    args["style"] = style
    args["query"][1, 0, 5] = np.nan
    want_q, want_k = REFERENCE(args)
    partner = 5 + 32 if style == "neox" else 4
    assert np.isnan(want_q[1, 0, [5, partner]]).all() and np.isnan(want_q).sum() == 2
    got_q, got_k = _run(hal_backend, args)
    assert_close(got_q, want_q, kind="rotary", dtype="fp32", what="query")
    assert got_k is not None
    assert_close(got_k, want_k, kind="rotary", dtype="fp32", what="key")


def test_rotary_embedding_no_tokens(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """num_tokens = 0 is a no-op."""
    args = rotary_embedding_inputs(hal_rng, num_tokens=0, num_heads=2, num_kv_heads=1, head_size=64, dtype="fp16")
    got_q, got_k = _run(hal_backend, args)
    assert got_q.shape == (0, 2, 64) and got_k is not None and got_k.shape == (0, 1, 64)


BAD_INPUTS = [
    ("positions-dtype", ArgumentTypeError, "positions"),
    ("query-rank", ArgumentError, "query"),
    ("key-dtype", ArgumentTypeError, "key"),
    ("key-tokens", ArgumentError, "key"),
    ("key-head-size", ArgumentError, "key"),
    ("table-dtype", ArgumentTypeError, "cos_sin_cache"),
    ("rotary-dim-odd", ArgumentError, "cos_sin_cache"),
    ("rotary-dim-too-large", ArgumentError, "cos_sin_cache"),
    ("style", ArgumentError, "style"),
    ("key-is-query", ArgumentError, "key"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_rotary_embedding_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                    error: type[Exception], argument: str) -> None:
    """Bad input raises the right error naming the argument and leaves query and key untouched."""
    args = rotary_embedding_inputs(hal_rng, num_tokens=4, num_heads=4, num_kv_heads=2, head_size=64, dtype="fp32")
    style = None
    if case == "positions-dtype":
        args["positions"] = args["positions"].astype(np.float32)
    elif case == "query-rank":
        args["query"] = args["query"][0].copy()
    elif case == "key-dtype":
        args["key"] = args["key"].astype(np.float16)
    elif case == "key-tokens":
        args["key"] = args["key"][:3].copy()
    elif case == "key-head-size":
        args["key"] = np.zeros((4, 2, 32), np.float32)
    elif case == "table-dtype":
        args["cos_sin_cache"] = args["cos_sin_cache"].astype(np.float16)
    elif case == "rotary-dim-odd":
        args["cos_sin_cache"] = np.ascontiguousarray(args["cos_sin_cache"][:, :63])
    elif case == "rotary-dim-too-large":
        args["cos_sin_cache"] = np.zeros((64, 66), np.float32)
    elif case == "style":
        style = "halves"
    before_q, before_k = args["query"].copy(), args["key"].copy()
    dev = to_backend(hal_backend, "rotary_embedding", args)
    if case == "key-is-query":
        dev["key"] = dev["query"]
    with pytest.raises(error) as info:
        hal_backend.ops.rotary_embedding(dev["positions"], dev["query"], dev["cos_sin_cache"], key=dev["key"],
                                         style=style)
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    if case != "query-rank":
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["query"]), before_q)
    if case not in ("key-dtype", "key-tokens", "key-head-size", "key-is-query"):
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["key"]), before_k)


@pytest.mark.parametrize("bad", [64, -1])
def test_rotary_embedding_position_out_of_range(hal_backend: Any, hal_rng: np.random.Generator, bad: int) -> None:
    """A position outside the table is refused naming positions (host), or skipped and reported (device).

    Host arrays: an ``ArgumentError`` at the call, query and key untouched. Device arrays may be checked by the
    kernel instead: the token is left as it is, the others rotate, and :func:`hal_core.check_errors` raises.
    """
    args = rotary_embedding_inputs(hal_rng, num_tokens=4, num_heads=2, num_kv_heads=1, head_size=64, dtype="fp32",
                                   max_position=64, poison=False)
    args["positions"][2] = bad
    before_q, before_k = args["query"].copy(), args["key"].copy()
    dev = to_backend(hal_backend, "rotary_embedding", args)
    try:
        hal_backend.ops.rotary_embedding(dev["positions"], dev["query"], dev["cos_sin_cache"], key=dev["key"])
    except ArgumentError as exc:
        assert "'positions'" in str(exc), f"message does not name 'positions': {exc}"
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["query"]), before_q)
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["key"]), before_k)
        return
    assert not hal_backend.is_host, "a host backend must check positions before any write"
    with pytest.raises(ArgumentError, match="'positions'"):
        hal_core.check_errors()
    keep = np.arange(4) != 2
    want_q, want_k = REFERENCE(dict(args, positions=args["positions"][keep], query=before_q[keep], key=before_k[keep]))
    got_q, got_k = hal_backend.to_numpy(dev["query"]), hal_backend.to_numpy(dev["key"])
    assert_close(got_q[keep], want_q, kind="rotary", dtype="fp32", what="query")
    assert_close(got_k[keep], want_k, kind="rotary", dtype="fp32", what="key")
    np.testing.assert_array_equal(got_q[2], before_q[2])
    np.testing.assert_array_equal(got_k[2], before_k[2])
