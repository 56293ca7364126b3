"""paged_attention against the float64 reference, plus its edge cases and bad-input errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, paged_attention_inputs, to_backend
from hal_core.testing.suite._strategies import BLOCK_SIZES, DTYPES, GQA_RATIOS, HEAD_SIZES, OP_SETTINGS, seeds

REFERENCE = OPS["paged_attention"].reference


def _run(backend: Any, args: dict[str, Any], out: Any = None, dev: dict[str, Any] | None = None,
         max_seq_len: int | None = None) -> np.ndarray:
    dev = dev if dev is not None else to_backend(backend, "paged_attention", args)
    result = backend.ops.paged_attention(
        dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"], dev["seq_lens"],
        scale=args["scale"], out=out, max_seq_len=max_seq_len,
    )
    return backend.to_numpy(result)


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    head_size=st.sampled_from(HEAD_SIZES),
    block_size=st.sampled_from(BLOCK_SIZES),
    ratio=st.sampled_from(GQA_RATIOS),
    num_kv_heads=st.integers(1, 2),
    seq_lens=st.lists(st.integers(0, 300), min_size=1, max_size=5),
)
def test_paged_attention_matches_reference(hal_backend: Any, seed: int, dtype: str, head_size: int,
                                           block_size: int, ratio: int, num_kv_heads: int,
                                           seq_lens: list[int]) -> None:
    """Random shapes, GQA ratios and block tables (zero-length sequences included) match float64."""
    rng = np.random.default_rng(seed)
    args = paged_attention_inputs(rng, seq_lens=seq_lens, num_heads=num_kv_heads * ratio,
                                  num_kv_heads=num_kv_heads, head_size=head_size,
                                  block_size=block_size, dtype=dtype)
    got = _run(hal_backend, args)
    assert got.dtype == args["query"].dtype
    assert_close(got, REFERENCE(args), kind="attention", dtype=dtype, what="paged_attention")


@pytest.mark.parametrize("head_size", HEAD_SIZES, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_every_head_size(hal_backend: Any, hal_rng: np.random.Generator, dtype: str,
                                         head_size: int) -> None:
    """Each supported head size, with a long sequence crossing many blocks and an empty one."""
    args = paged_attention_inputs(hal_rng, seq_lens=[700, 0, 33], num_heads=8, num_kv_heads=2,
                                  head_size=head_size, block_size=16, dtype=dtype)
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="attention", dtype=dtype)


def test_paged_attention_zero_length_sequences_give_zeros(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """Sequences of length 0 produce exact zeros."""
    args = paged_attention_inputs(hal_rng, seq_lens=[0, 0, 0], num_heads=4, num_kv_heads=1,
                                  head_size=64, block_size=8, dtype="fp32")
    got = _run(hal_backend, args)
    assert not got.any()


def test_paged_attention_no_sequences(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """num_seqs = 0 returns an empty [0, num_heads, head_size] array of the query's dtype."""
    args = paged_attention_inputs(hal_rng, seq_lens=[], num_heads=4, num_kv_heads=2,
                                  head_size=64, block_size=16, dtype="fp16")
    got = _run(hal_backend, args)
    assert got.shape == (0, 4, 64) and got.dtype == np.float16


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_writes_out(hal_backend: Any, hal_rng: np.random.Generator, dtype: str) -> None:
    """With out=, the result lands in out and out is returned."""
    args = paged_attention_inputs(hal_rng, seq_lens=[5, 40], num_heads=8, num_kv_heads=8,
                                  head_size=128, block_size=32, dtype=dtype)
    out = hal_backend.asarray(np.zeros_like(args["query"]))
    dev = to_backend(hal_backend, "paged_attention", args)
    result = hal_backend.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                                             dev["block_tables"], dev["seq_lens"], scale=args["scale"], out=out)
    assert result is out
    assert_close(hal_backend.to_numpy(out), REFERENCE(args), kind="attention", dtype=dtype)


@pytest.mark.parametrize("slack", [0, 1, 5000], ids=["exact", "plus1", "beyond-table"])
def test_paged_attention_max_seq_len(hal_backend: Any, hal_rng: np.random.Generator, slack: int) -> None:
    """A max_seq_len at or above every length (even beyond the table's capacity) gives the same result."""
    args = paged_attention_inputs(hal_rng, seq_lens=[700, 0, 33], num_heads=8, num_kv_heads=2,
                                  head_size=64, block_size=16, dtype="fp16")
    got = _run(hal_backend, args, max_seq_len=700 + slack)
    assert_close(got, REFERENCE(args), kind="attention", dtype="fp16", what=f"max_seq_len=700+{slack}")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"], ids=repr)
def test_paged_attention_bad_max_seq_len(hal_backend: Any, hal_rng: np.random.Generator, bad: Any) -> None:
    """max_seq_len is checked on the host, before any work: a positive int or None."""
    args = _bad_inputs(hal_rng)
    with pytest.raises(ArgumentTypeError, match="'max_seq_len'"):
        _run(hal_backend, args, max_seq_len=bad)


def _bad_inputs(rng: np.random.Generator) -> dict[str, Any]:
    return paged_attention_inputs(rng, seq_lens=[20, 9], num_heads=4, num_kv_heads=2,
                                  head_size=64, block_size=8, dtype="fp32")


def _break(name: str, args: dict[str, Any]) -> None:
    """Make ``args`` invalid in the way ``name`` says."""
    if name == "query-rank":
        args["query"] = args["query"][0]
    elif name == "query-dtype":
        args["query"] = args["query"].astype(np.float64)
    elif name == "value-cache-shape":
        args["value_cache"] = args["value_cache"][:, :1].copy()
    elif name == "block-tables-dtype":
        args["block_tables"] = args["block_tables"].astype(np.int64)
    elif name in ("block-table-out-of-range", "block-table-out-of-range-index"):
        args["block_tables"][0, 0] = args["key_cache"].shape[0]
    elif name == "seq-len-beyond-table":
        args["seq_lens"][1] = args["block_tables"].shape[1] * args["key_cache"].shape[2] + 1
    elif name == "seq-lens-shape":
        args["seq_lens"] = args["seq_lens"][:1].copy()
    elif name == "seq-len-negative":
        args["seq_lens"][0] = -1
    elif name == "block-table-negative":  # in a used block (sequence 1 has 9 tokens: 2 blocks of 8)
        args["block_tables"][1, 1] = -1
    elif name == "kv-heads-not-dividing":  # 3 query heads over 2 KV heads
        args["query"] = args["query"][:, :3].copy()


BAD_INPUTS = [
    ("query-rank", ArgumentError, "query"),
    ("query-dtype", ArgumentTypeError, "query"),
    ("key-cache-last-dim-strided", ArgumentError, "key_cache"),
    ("value-cache-shape", ArgumentError, "value_cache"),
    ("block-tables-dtype", ArgumentTypeError, "block_tables"),
    ("seq-lens-shape", ArgumentError, "seq_lens"),
    ("kv-heads-not-dividing", ArgumentError, "key_cache"),
]

#: Bad index values: (case, argument, the sequence they spoil). The 20 and 9 tokens of _bad_inputs.
BAD_INDICES = [
    ("block-table-out-of-range", "block_tables", 0),
    ("seq-len-beyond-table", "seq_lens", 1),
    ("seq-len-negative", "seq_lens", 0),
    ("block-table-negative", "block_tables", 1),
    ("seq-len-beyond-max", "seq_lens", 0),  # 20 tokens with max_seq_len=15
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_paged_attention_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                   error: type[Exception], argument: str) -> None:
    """Bad input raises the right error type naming the argument, before touching out."""
    args = _bad_inputs(hal_rng)
    out_shape = args["query"].shape
    _break(case, args)
    dev = to_backend(hal_backend, "paged_attention", args)
    if case == "key-cache-last-dim-strided":  # sliced in the backend's domain, where asarray cannot fix it
        cache = args["key_cache"]
        wide = hal_backend.asarray(np.concatenate([cache, cache], axis=-1))
        dev["key_cache"] = wide[..., ::2]
    sentinel = np.full(out_shape, 7.0, dtype=np.float32)
    out = hal_backend.asarray(sentinel)
    with pytest.raises(error) as info:
        _run(hal_backend, args, out=out, dev=dev)
    assert isinstance(info.value, (ValueError, TypeError))
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(out), sentinel, err_msg="out was modified")


@pytest.mark.parametrize(("case", "argument", "spoilt"), BAD_INDICES, ids=[c[0] for c in BAD_INDICES])
def test_paged_attention_bad_index_values(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                          argument: str, spoilt: int) -> None:
    """A bad block id or length is never dereferenced and is reported naming the argument.

    Host arrays: an ``ArgumentError`` at the call, ``out`` untouched. Device arrays may instead be checked by
    the kernels (no host read): the call returns with the spoilt sequence's rows zeros and the others correct,
    and the error is raised by :func:`hal_core.check_errors`.
    """
    args = _bad_inputs(hal_rng)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    if case != "seq-len-beyond-max":
        _break(case, args)
    bound = 15 if case == "seq-len-beyond-max" else None
    sentinel = np.full(args["query"].shape, 7.0, dtype=np.float32)
    out = hal_backend.asarray(sentinel)
    try:
        got = _run(hal_backend, args, out=out, max_seq_len=bound)
    except ArgumentError as exc:
        assert repr(argument) in str(exc), f"message does not name {argument!r}: {exc}"
        np.testing.assert_array_equal(hal_backend.to_numpy(out), sentinel, err_msg="out was modified")
        return
    assert not hal_backend.is_host, "a host backend must check index values before any work"
    with pytest.raises(ArgumentError) as info:
        hal_core.check_errors()
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    assert not got[spoilt].any(), "the sequence with a bad index must give zeros"
    others = [s for s in range(got.shape[0]) if s != spoilt]
    assert_close(got[others], REFERENCE(good)[others], kind="attention", dtype="fp32", what=case)
    hal_core.check_errors()  # reported once


def test_paged_attention_bad_out(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """An out of the wrong shape or dtype is refused, naming 'out', and left untouched."""
    args = _bad_inputs(hal_rng)
    for bad in (np.full((2, 4, 32), 7.0, np.float32), np.full(args["query"].shape, 7.0, np.float16)):
        out = hal_backend.asarray(bad)
        with pytest.raises((ArgumentError, ArgumentTypeError), match="'out'"):
            _run(hal_backend, args, out=out)
        np.testing.assert_array_equal(hal_backend.to_numpy(out), bad)
