"""The index-value checks (block tables, sequence lengths, slot mappings) on both sides of the small-array path.

Each case is compared with a brute-force walk over the entries: the first
offender it finds is the one the error must name, or no error when it finds
none. Sizes straddle :data:`hal_core.ops._checks.SMALL_INDEX_ARRAY`, where
the check switches from Python lists to numpy reductions.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from hal_core import ArgumentError
from hal_core.ops._checks import SMALL_INDEX_ARRAY, check_block_tables, check_slots

SEED = 20261201
SHAPES = [(1, 1), (1, 3), (4, 8), (16, 16), (17, 16), (2, SMALL_INDEX_ARRAY // 2 + 1), (32, 64)]


def _first_table_problem(bt: np.ndarray, sl: np.ndarray, num_blocks: int, block_size: int) -> str | None:
    """Independent: walk lengths, then used entries, in row-major order; the message fragment expected."""
    capacity = bt.shape[1] * block_size
    for s, n in enumerate(sl.tolist()):
        if n < 0:
            return f"seq_lens[{s}] = {n}"
    for s, n in enumerate(sl.tolist()):
        if n > capacity:
            return f"seq_lens[{s}] = {n}"
    for s, n in enumerate(sl.tolist()):
        for j in range((n + block_size - 1) // block_size):
            if not 0 <= bt[s, j] < num_blocks:
                return f"block_tables[{s}, {j}] = {bt[s, j]}"
    return None


def _random_table(rng: np.random.Generator, num_seqs: int, max_blocks: int, block_size: int,
                  num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    sl = rng.integers(0, max_blocks * block_size + 1, num_seqs).astype(np.int32)
    bt = rng.integers(0, num_blocks, (num_seqs, max_blocks)).astype(np.int32)
    for s, n in enumerate(sl.tolist()):  # garbage past each sequence's used blocks, as engines leave it
        used = -(-n // block_size)
        bt[s, used:] = rng.choice([-1, num_blocks, num_blocks + 7, 0], max_blocks - used)
    return bt, sl


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s}x{b}" for s, b in SHAPES])
@pytest.mark.parametrize("fault", ["none", "negative-len", "len-beyond-table", "used-negative", "used-too-big"])
def test_block_table_check_names_the_first_offender(shape: tuple[int, int], fault: str) -> None:
    """Valid tables (with garbage past the used blocks) pass; each kind of fault is named at its first place."""
    rng = np.random.default_rng([SEED, *shape, len(fault)])
    print(f"seed {[SEED, *shape, len(fault)]}")
    num_seqs, max_blocks = shape
    block_size, num_blocks = 16, 3 * max_blocks + 1
    for _ in range(20):
        bt, sl = _random_table(rng, num_seqs, max_blocks, block_size, num_blocks)
        s = int(rng.integers(num_seqs))
        if fault == "negative-len":
            sl[s] = -int(rng.integers(1, 5))
        elif fault == "len-beyond-table":
            sl[s] = max_blocks * block_size + int(rng.integers(1, 40))
        elif fault in ("used-negative", "used-too-big"):
            sl[s] = max(sl[s], 1)
            j = int(rng.integers(-(-int(sl[s]) // block_size)))
            bt[s, j] = -3 if fault == "used-negative" else num_blocks + int(rng.integers(0, 3))
        expected = _first_table_problem(bt, sl, num_blocks, block_size)
        if expected is None:
            check_block_tables(bt, sl, num_blocks, block_size)
            continue
        argument = "'seq_lens'" if expected.startswith("seq_lens") else "'block_tables'"
        with pytest.raises(ArgumentError, match=re.escape(argument) + ".*" + re.escape(expected) + "$"):
            check_block_tables(bt, sl, num_blocks, block_size)


def _first_slot_problem(slots: np.ndarray, capacity: int) -> str | None:
    """Independent: a slot at or beyond ``capacity`` first (named), else a repeated non-negative slot."""
    for i, slot in enumerate(slots.tolist()):
        if slot >= capacity:
            return f"slot_mapping[{i}] = {slot}"
    seen: set[int] = set()
    for slot in slots.tolist():
        if slot >= 0 and slot in seen:
            return "a slot used twice"
        seen.add(slot)
    return None


@pytest.mark.parametrize("num_tokens", [1, 2, 7, SMALL_INDEX_ARRAY, SMALL_INDEX_ARRAY + 1, 3000])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("fault", ["none", "too-big", "repeated", "repeated-negative-ok"])
def test_slot_check_matches_a_brute_force_walk(num_tokens: int, dtype: type, fault: str) -> None:
    """Distinct in-range slots (some negative: skipped) pass; a slot out of range or used twice is refused."""
    rng = np.random.default_rng([SEED, num_tokens, len(fault)])
    print(f"seed {[SEED, num_tokens, len(fault)]}")
    capacity = 2 * num_tokens + 3
    for _ in range(10):
        slots = rng.permutation(capacity)[:num_tokens].astype(dtype)
        slots[rng.random(num_tokens) < 0.25] = -1
        i = int(rng.integers(num_tokens))
        if fault == "too-big":
            slots[i] = capacity + int(rng.integers(0, 3))
        elif fault == "repeated" and num_tokens > 1:
            others = [k for k in range(num_tokens) if k != i]
            slots[i] = max(0, int(slots[int(rng.choice(others))]))
            slots[int(rng.choice(others))] = slots[i]
        elif fault == "repeated-negative-ok":
            slots[rng.random(num_tokens) < 0.5] = -int(rng.integers(1, 4))  # repeated negatives are skips
        expected = _first_slot_problem(slots, capacity)
        if expected is None:
            check_slots(slots, capacity)
            continue
        with pytest.raises(ArgumentError, match="'slot_mapping'.*" + re.escape(expected) + "$"):
            check_slots(slots, capacity)
