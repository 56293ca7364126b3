"""The index checks a step's layers share: a call whose index arrays hold the values of the last call that passed
skips the value checks; any changed value, shape, dtype or size the check compares against is checked again."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError
from hal_core.ops import _checks, _index_memo, paged_attention, write_kv_cache

NUM_BLOCKS, KV_HEADS, BLOCK, HEAD, HEADS = 12, 2, 4, 16, 4


@pytest.fixture
def cpu() -> Any:
    return hal_core.get_backend("cpu")


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each value check ran (counting, then running the real one)."""
    counts = {"tables": 0, "slots": 0}
    real_tables, real_slots = _checks.check_block_tables, _checks.check_slots

    def tables(*args: Any, **kwargs: Any) -> None:
        counts["tables"] += 1
        real_tables(*args, **kwargs)

    def slots(*args: Any, **kwargs: Any) -> None:
        counts["slots"] += 1
        real_slots(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "check_block_tables", tables)
    monkeypatch.setattr(write_kv_cache, "check_slots", slots)
    paged_attention._PASSED.forget()
    write_kv_cache._PASSED.forget()
    return counts


def _step(rng: np.random.Generator, num_seqs: int = 3) -> dict[str, Any]:
    """One decode step's arguments: a new token per sequence, lengths 1..8, distinct blocks."""
    kc = rng.standard_normal((NUM_BLOCKS, KV_HEADS, BLOCK, HEAD)).astype(np.float32)
    tables = rng.permutation(NUM_BLOCKS)[: num_seqs * 2].reshape(num_seqs, 2).astype(np.int32)
    lens = rng.integers(1, 2 * BLOCK + 1, num_seqs).astype(np.int32)
    return {"key_cache": kc, "value_cache": rng.standard_normal(kc.shape).astype(np.float32),
            "query": rng.standard_normal((num_seqs, HEADS, HEAD)).astype(np.float32),
            "block_tables": tables, "seq_lens": lens, "query_start_loc": np.arange(num_seqs + 1, dtype=np.int32),
            "max_query_len": 1, "max_seq_len": 2 * BLOCK, "scale": HEAD ** -0.5}


def test_the_layers_of_a_step_check_the_tables_once(cpu: Any, hal_rng: np.random.Generator,
                                                    checks: dict[str, int]) -> None:
    """Four layers (four bound ops, as an engine's) given copies of one step's arrays: one check; results exact."""
    args = _step(hal_rng)
    caches = [(args["key_cache"].copy(), args["value_cache"].copy()) for _ in range(4)]
    layers = [cpu.ops.bind("paged_attention", key_cache=k, value_cache=v) for k, v in caches]
    index = ("block_tables", "seq_lens", "query_start_loc")
    rest = {name: value for name, value in args.items() if name not in ("key_cache", "value_cache")}
    expected = hal_core.ops.OPS["paged_attention"].reference(args)
    for layer in layers:
        copies = {name: rest[name].copy() for name in index}  # new arrays, same values (an engine's refill)
        got = layer(**{**rest, **copies})
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert checks["tables"] == 1


@pytest.mark.parametrize("change", ["table-entry", "length", "shape", "max_seq_len", "num_blocks"])
def test_a_changed_value_is_checked_again(cpu: Any, hal_rng: np.random.Generator, checks: dict[str, int],
                                          change: str) -> None:
    """After a pass, a call differing in one value (or a shape, or a size the check compares against) is checked
    again, and refused where the new value is out of range."""
    args = _step(hal_rng)
    cpu.ops.paged_attention(**args)
    assert checks["tables"] == 1
    bad = {**args}
    if change == "table-entry":
        bad["block_tables"] = args["block_tables"].copy()
        bad["block_tables"][0, 0] = NUM_BLOCKS  # used by every sequence (lengths >= 1)
    elif change == "length":
        bad["seq_lens"] = args["seq_lens"].copy()
        bad["seq_lens"][1] = 2 * BLOCK + 1  # beyond the table's capacity
    elif change == "shape":
        bad["block_tables"] = np.concatenate([args["block_tables"], np.full((3, 1), -1, np.int32)], axis=1)
    elif change == "max_seq_len":
        bad["max_seq_len"] = int(args["seq_lens"].max()) - 1
    else:
        used = int(args["block_tables"][:, 0].max())  # a used entry (every length is >= 1) past the new cache
        bad["key_cache"], bad["value_cache"] = args["key_cache"][:used], args["value_cache"][:used]
    if change == "shape":  # still valid: checked again, passes
        cpu.ops.paged_attention(**bad)
    else:
        with pytest.raises(ArgumentError, match=r"block_tables|seq_lens"):
            cpu.ops.paged_attention(**bad)
    assert checks["tables"] == 2


def test_an_array_refilled_in_place_is_checked_again(cpu: Any, hal_rng: np.random.Generator,
                                                     checks: dict[str, int]) -> None:
    """The same array objects, one entry overwritten in place with an out-of-range block: refused."""
    args = _step(hal_rng)
    layer = cpu.ops.bind("paged_attention", key_cache=args["key_cache"], value_cache=args["value_cache"])
    rest = {name: value for name, value in args.items() if name not in ("key_cache", "value_cache")}
    layer(**rest)
    args["block_tables"][2, 0] = -1
    with pytest.raises(ArgumentError, match=r"block_tables\[2, 0\] = -1"):
        layer(**rest)
    assert checks["tables"] == 2


def test_slot_mappings_shared_by_the_layers(cpu: Any, hal_rng: np.random.Generator, checks: dict[str, int]) -> None:
    """write_kv_cache: one check for the same slots; a slot used twice after a pass is refused."""
    kc = np.zeros((NUM_BLOCKS, KV_HEADS, BLOCK, HEAD), np.float32)
    vc = np.zeros_like(kc)
    key = hal_rng.standard_normal((5, KV_HEADS, HEAD)).astype(np.float32)
    slots = hal_rng.permutation(NUM_BLOCKS * BLOCK)[:5].astype(np.int64)
    for _ in range(3):
        cpu.ops.write_kv_cache(key, key, kc, vc, slots.copy())
    assert checks["slots"] == 1
    np.testing.assert_array_equal(kc.transpose(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD)[slots], key)
    twice = slots.copy()
    twice[4] = twice[0]
    with pytest.raises(ArgumentError, match="a slot used twice"):
        cpu.ops.write_kv_cache(key, key, kc, vc, twice)
    assert checks["slots"] == 2


def test_arrays_beyond_the_kept_size_are_checked_every_time(cpu: Any, checks: dict[str, int]) -> None:
    """A slot mapping larger than MAX_KEPT_BYTES is checked on every call (nothing kept)."""
    tokens = _index_memo.MAX_KEPT_BYTES // 8 + 1
    blocks = -(-tokens // BLOCK)
    kc = np.zeros((blocks, 1, BLOCK, 8), np.float32)
    key = np.ones((tokens, 1, 8), np.float32)
    slots = np.arange(tokens, dtype=np.int64)
    for _ in range(2):
        cpu.ops.write_kv_cache(key, key, kc, np.zeros_like(kc), slots)
    assert checks["slots"] == 2


def test_key_is_exact() -> None:
    """Equal keys only for equal sizes, shapes, dtypes and bytes; None past the size limit."""
    kept = _index_memo.PassedIndices()
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    key = kept.key((1,), a, None)
    kept.keep(key)
    assert kept.passed(kept.key((1,), a.copy(), None))
    assert not kept.passed(kept.key((2,), a, None))
    assert not kept.passed(kept.key((1,), a.reshape(3, 2), None))
    assert not kept.passed(kept.key((1,), a.astype(np.int64), None))
    assert not kept.passed(kept.key((1,), a, a[:1]))
    big = np.zeros(_index_memo.MAX_KEPT_BYTES // 4 + 1, np.int32)
    assert kept.key((1,), big) is None and not kept.passed(None)
