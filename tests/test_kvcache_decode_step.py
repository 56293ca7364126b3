"""Decode steps that update the last step's arrays: the same arrays a rebuild gives, whatever came between."""

from __future__ import annotations

import numpy as np
import pytest

from hal_core import OutOfBlocksError
from hal_core.kvcache import CacheConfig, PagedKVCache, StepInputs


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _cache(cpu, num_blocks: int = 64, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(cpu, CacheConfig(num_layers=1, num_kv_heads=1, head_size=8, block_size=block_size,
                                         dtype="fp32"), num_blocks=num_blocks)


def _expected(cache: PagedKVCache, counts: dict[object, int], max_blocks: int | None = None) -> dict[str, np.ndarray]:
    """The step's arrays built from the block bookkeeping alone, after the step grew the sequences."""
    blocks = cache.blocks
    seq_ids = list(counts)
    lengths = [blocks.length(s) for s in seq_ids]
    pairs = list(zip(seq_ids, lengths, strict=True))
    tables = [blocks.blocks(s) for s in seq_ids]
    width = max_blocks if max_blocks is not None else max(1, max((len(t) for t in tables), default=0))
    table = np.zeros((len(seq_ids), width), np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return {
        "slot_mapping": np.concatenate([blocks.slots(s, n - counts[s], n) for s, n in pairs]
                                       + [np.zeros(0, np.int64)]),
        "block_tables": table, "seq_lens": np.asarray(lengths, np.int32),
        "query_start_loc": np.concatenate([[0], np.cumsum([counts[s] for s in seq_ids])]).astype(np.int32),
        "positions": np.concatenate([np.arange(n - counts[s], n) for s, n in pairs]
                                    + [np.zeros(0, np.int64)]),
    }


def _check(step: StepInputs, cache: PagedKVCache, counts: dict[object, int], max_blocks: int | None = None) -> None:
    want = _expected(cache, counts, max_blocks)
    for name, expected in want.items():
        got = np.asarray(getattr(step, name))
        assert got.dtype == expected.dtype or name == "positions", name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert step.max_seq_len == max(1, int(want["seq_lens"].max(initial=0)))
    assert step.max_query_len == max(1, max(counts.values(), default=0))
    np.testing.assert_array_equal(step.row_seq, np.repeat(np.arange(len(counts)), list(counts.values())))


def test_decode_steps_between_other_changes_match_a_rebuild(cpu, rng: np.random.Generator) -> None:
    """Random prompts, decode runs, forks, truncations and frees: every step's arrays equal the bookkeeping's,
    and arrays handed out earlier are never written afterwards."""
    cache = _cache(cpu, num_blocks=1024)
    live: list[int] = []
    next_id = 0
    handed: list[tuple[StepInputs, dict[str, np.ndarray]]] = []
    for _ in range(120):
        action = rng.integers(6) if len(live) < 6 else rng.integers(2, 6)  # at most 6 sequences
        if action == 0 or not live:
            cache.add(next_id)
            live.append(next_id)
            next_id += 1
            counts = {s: int(rng.integers(0, 7)) for s in live}
        elif action == 1:
            parent = live[int(rng.integers(len(live)))]
            cache.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
            continue
        elif action == 2 and len(live) > 1:
            cache.free(live.pop(int(rng.integers(len(live)))))
            continue
        elif action == 3:
            victim = live[int(rng.integers(len(live)))]
            cache.truncate_many({victim: int(rng.integers(0, cache.blocks.length(victim) + 1))})
            continue
        else:
            counts = dict.fromkeys(live, 1)  # a decode step (after a decode step, the updated path)
        step = cache.prepare_step(counts)
        _check(step, cache, counts)
        cache.blocks.check()
        handed.append((step, {n: np.array(getattr(step, n)) for n in ("slot_mapping", "block_tables", "seq_lens",
                                                                          "query_start_loc", "row_seq")}))
    for step, copies in handed:
        for name, copy in copies.items():
            np.testing.assert_array_equal(np.asarray(getattr(step, name)), copy, err_msg=name)


def test_a_decode_step_hands_out_unchanged_arrays_again(cpu) -> None:
    """Within a block the block tables and the packing are the same arrays; a new block makes new tables."""
    cache = _cache(cpu, block_size=4)
    cache.add("a")
    cache.add("b")
    cache.prepare_step({"a": 2, "b": 3})
    first = cache.prepare_step({"a": 1, "b": 1})  # a: 3 tokens, b: 4
    second = cache.prepare_step({"a": 1, "b": 1})  # a: 4, b: 5 (a new block)
    third = cache.prepare_step({"a": 1, "b": 1})  # a: 5 (a new block), b: 6
    fourth = cache.prepare_step({"a": 1, "b": 1})
    assert second.query_start_loc is first.query_start_loc
    assert second.block_tables is not first.block_tables and third.block_tables is not second.block_tables
    assert fourth.block_tables is third.block_tables
    _check(fourth, cache, {"a": 1, "b": 1})


def test_out_of_blocks_in_a_decode_step_changes_nothing(cpu) -> None:
    """A decode step that needs more blocks than are free raises and leaves lengths, blocks and the next step as
    they were."""
    cache = _cache(cpu, num_blocks=3, block_size=2)
    for s in ("a", "b"):
        cache.add(s)
    cache.prepare_step({"a": 2, "b": 1})
    cache.prepare_step({"a": 1, "b": 1})  # a: 3 tokens in 2 blocks, b: 2 in 1: no block free
    before = (cache.blocks.length("a"), cache.blocks.blocks("a"), cache.blocks.length("b"), cache.blocks.blocks("b"))
    with pytest.raises(OutOfBlocksError):
        cache.prepare_step({"a": 1, "b": 1})  # b needs a block
    assert (cache.blocks.length("a"), cache.blocks.blocks("a"), cache.blocks.length("b"),
            cache.blocks.blocks("b")) == before
    cache.blocks.check()
    cache.free("b")
    step = cache.prepare_step({"a": 1})
    _check(step, cache, {"a": 1})


def test_a_decode_step_too_wide_for_max_blocks_changes_nothing(cpu) -> None:
    """With max_blocks, a decode step whose table would outgrow it raises ValueError before growing anything."""
    cache = _cache(cpu, block_size=2)
    cache.add("a")
    step = cache.prepare_step({"a": 3}, max_blocks=2)
    step = cache.prepare_step({"a": 1}, max_blocks=2)
    _check(step, cache, {"a": 1}, max_blocks=2)
    with pytest.raises(ValueError, match="max_blocks=2"):
        cache.prepare_step({"a": 1}, max_blocks=2)
    assert cache.blocks.length("a") == 4
    step = cache.prepare_step({"a": 1}, max_blocks=3)
    _check(step, cache, {"a": 1}, max_blocks=3)


def test_a_count_that_is_not_one_int_takes_the_general_path(cpu) -> None:
    """A bool count is refused as in any step; a numpy int count of one is a decode step with the same arrays."""
    cache = _cache(cpu)
    cache.add("a")
    cache.prepare_step({"a": 2})
    cache.prepare_step({"a": 1})
    with pytest.raises(ValueError, match="num_tokens"):
        cache.prepare_step({"a": True})
    assert cache.blocks.length("a") == 3
    step = cache.prepare_step({"a": np.int64(1)})
    _check(step, cache, {"a": 1})
