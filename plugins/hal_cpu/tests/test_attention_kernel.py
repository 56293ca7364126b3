"""The compiled paged_attention kernel against the float64 reference: dtypes, GQA, sizes, split-KV, NaN/Inf."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cpu.ops import paged_attention

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, paged_attention_inputs

REFERENCE = OPS["paged_attention"].reference
LENS = [0, 1, 17, 64, 300, 5, 129]


def _attend(args: dict, **knobs: int) -> np.ndarray:
    return paged_attention.attend(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                  args["seq_lens"], args["scale"], **knobs)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1), (32, 8), (12, 1)],
                         ids=["mha", "gqa4", "mqa8", "gqa32-8", "mqa12"])
@pytest.mark.parametrize("partition_tokens", [0, 16, 48], ids=["no-split", "split16", "split48"])
def test_matches_reference(variant: str, rng: np.random.Generator, dtype: str, num_heads: int, num_kv_heads: int,
                           partition_tokens: int) -> None:
    """Ragged lengths (0 included), NaN-poisoned unused slots and garbage table entries, split or not."""
    args = paged_attention_inputs(rng, seq_lens=LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_size=64, block_size=16, dtype=dtype)
    got = _attend(args, partition_tokens=partition_tokens, threads=2)
    assert_close(got, REFERENCE(args), kind="attention", dtype=dtype, what=f"{variant} attention")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])  # bf16: head sizes with and without the vdpbf16ps path
@pytest.mark.parametrize("head_size", [40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 48])
def test_head_and_block_sizes(variant: str, rng: np.random.Generator, head_size: int, block_size: int,
                              dtype: str) -> None:
    """Head sizes that fill SIMD vectors or leave a tail; blocks smaller and larger than a scoring chunk."""
    args = paged_attention_inputs(rng, seq_lens=[3, 70, 33], num_heads=8, num_kv_heads=2, head_size=head_size,
                                  block_size=block_size, dtype=dtype)
    assert_close(_attend(args), REFERENCE(args), kind="attention", dtype=dtype, what=f"{variant} attention")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(rng: np.random.Generator, threads: int) -> None:
    """The result does not depend on the thread count (tasks are independent; merges run per head)."""
    args = paged_attention_inputs(rng, seq_lens=[700, 1, 260], num_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp32")
    serial = _attend(args, partition_tokens=128, threads=1)
    np.testing.assert_array_equal(_attend(args, partition_tokens=128, threads=threads), serial)


def _poison(args: dict, what: str, value: float, seq: int, token: int) -> None:
    """Write ``value`` into row ``token`` of sequence ``seq`` of the query, key or value (all of KV head 0)."""
    if what == "query":
        args["query"][seq, 0, 3] = value
        return
    block = args["block_tables"][seq, token // args["key_cache"].shape[2]]
    cache = args["key_cache" if what == "key" else "value_cache"]
    cache[block, 0, token % cache.shape[2], 5] = value


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference's inf - inf
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the vdpbf16ps score path where the CPU has it
@pytest.mark.parametrize("partition_tokens", [0, 32], ids=["no-split", "split"])
@pytest.mark.parametrize(("what", "value"), [("query", np.nan), ("key", np.nan), ("key", np.inf),
                                             ("key", -np.inf), ("value", np.nan), ("value", np.inf)])
def test_non_finite_inputs_propagate_like_the_reference(variant: str, rng: np.random.Generator, what: str,
                                                        value: float, partition_tokens: int, dtype: str) -> None:
    """NaN/Inf in the query or a used key/value row gives exactly the reference's NaN pattern (never zeros)."""
    args = paged_attention_inputs(rng, seq_lens=[90, 40], num_heads=4, num_kv_heads=2, head_size=32,
                                  block_size=8, dtype=dtype)
    _poison(args, what, value, seq=0, token=70)
    expected = REFERENCE(args)
    assert not np.isfinite(expected).all() or what == "key", "the poisoned input must matter"
    got = _attend(args, partition_tokens=partition_tokens)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert_close(got[finite], expected[finite], kind="attention", dtype=dtype,
                 what=f"{variant} {dtype} attention with {what}={value}")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference's -inf - -inf
def test_all_scores_minus_inf_give_nan(rng: np.random.Generator) -> None:
    """A head whose every score is -inf has no softmax: NaN, as the reference (not zeros)."""
    args = paged_attention_inputs(rng, seq_lens=[5], num_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                                  dtype="fp32")
    args["query"][0, 0] = 1.0
    block = args["block_tables"][0, 0]
    args["key_cache"][block, 0, :5, :] = -np.inf
    expected = REFERENCE(args)
    assert np.isnan(expected[0, 0]).all()
    got = _attend(args)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))


def test_strided_query(rng: np.random.Generator) -> None:
    """A query sliced out of a fused projection (rows strided, head_size contiguous) is read in place."""
    args = paged_attention_inputs(rng, seq_lens=[33, 8], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                                  dtype="bf16")
    fused = np.zeros((2, 12, 64), dtype=args["query"].dtype)
    fused[:, :8] = args["query"]
    args_strided = dict(args, query=fused[:, :8])
    assert not args_strided["query"].flags.c_contiguous
    np.testing.assert_array_equal(_attend(args_strided), _attend(args))


@pytest.mark.parametrize(("num_seqs", "max_len", "threads", "expected"), [
    (1, 32768, 2, 4096),   # one long sequence: cut so that every thread gets TASKS_PER_THREAD partitions
    (4, 8192, 2, 4096),
    (8, 512, 2, 0),        # enough sequences for the threads: no split, no merge
    (32, 4096, 2, 0),
    (1, 200, 2, 0),        # shorter than a partition is worth
    (1, 32768, 1, 0),      # one thread: nothing to balance
    (1, 1000, 2, 256),     # at least MIN_PARTITION_TOKENS, a multiple of the block size
])
def test_partition_rule(num_seqs: int, max_len: int, threads: int, expected: int) -> None:
    """A task covers every KV head of its tokens, so the split depends on sequences, not (sequence, head) pairs."""
    from hal_cpu.ops import _rules

    for kv_heads in (1, 8):
        assert _rules.attention_partition_tokens(num_seqs, kv_heads, max_len, 16, threads) == expected
