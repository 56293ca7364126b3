"""Block bookkeeping of the paged KV cache, driven by a Hypothesis state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hal_core import OutOfBlocksError
from hal_core.kvcache import BlockTable, ForkCopy

NUM_BLOCKS = 12
BLOCK_SIZE = 4


def _snapshot(table: BlockTable) -> tuple:
    seqs = {s: (table.blocks(s), table.length(s)) for s in table.seq_ids}
    return seqs, sorted(table._free), [table.refcount(b) for b in range(table.num_blocks)]


class BlockMachine(RuleBasedStateMachine):
    """Random add, grow, fork and free; tokens written through slots must read back per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(NUM_BLOCKS, BLOCK_SIZE)
        self.cells = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)  # a one-number-per-token "cache"
        self.model: dict[int, list[int]] = {}  # the logical tokens of every sequence
        self.next_id = 0
        self.next_token = 0

    def _tokens(self, n: int) -> list[int]:
        start = self.next_token
        self.next_token += n
        return list(range(start, start + n))

    def _expect_unchanged_on_error(self, action) -> bool:
        before = _snapshot(self.table)
        try:
            action()
        except OutOfBlocksError as exc:
            assert _snapshot(self.table) == before, "a failed call changed the state"
            assert exc.needed > exc.free == self.table.num_free
            return False
        return True

    @rule(n=st.integers(0, 3 * BLOCK_SIZE + 1))
    def add(self, n: int) -> None:
        seq = self.next_id
        self.next_id += 1
        if self._expect_unchanged_on_error(lambda: self.table.add(seq, n)):
            tokens = self._tokens(n)
            self.cells[self.table.slots(seq)] = tokens
            self.model[seq] = tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 2 * BLOCK_SIZE + 1))
    def grow(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        result: dict = {}
        if self._expect_unchanged_on_error(lambda: result.update(slots=self.table.extend(seq, n))):
            tokens = self._tokens(n)
            assert (self.cells[result["slots"]] == -1).all() or n == 0, "grow handed out a slot in use"
            self.cells[result["slots"]] = tokens
            self.model[seq] += tokens

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def grow_many(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        growth = {s: data.draw(st.integers(0, BLOCK_SIZE + 2)) for s in seqs}
        result: dict = {}
        if self._expect_unchanged_on_error(lambda: result.update(self.table.extend_many(growth))):
            for seq, slots in result.items():
                tokens = self._tokens(growth[seq])
                self.cells[slots] = tokens
                self.model[seq] += tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = self.next_id
        self.next_id += 1
        result: dict = {}
        if self._expect_unchanged_on_error(lambda: result.update(copy=self.table.fork(parent, child))):
            copy: ForkCopy | None = result["copy"]
            partial = len(self.model[parent]) % BLOCK_SIZE != 0
            assert (copy is not None) == partial
            if copy is not None:  # what PagedKVCache does on the device
                cells = self.cells.reshape(NUM_BLOCKS, BLOCK_SIZE)
                cells[copy.dst] = cells[copy.src]
            self.model[child] = list(self.model[parent])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        blocks = self.table.blocks(seq)
        self.table.free(seq)
        del self.model[seq]
        cells = self.cells.reshape(NUM_BLOCKS, BLOCK_SIZE)
        for block in blocks:  # a block nobody holds any more is stale: mark it so reuse is visible
            if self.table.refcount(block) == 0:
                cells[block] = -1

    @rule()
    def unknown_sequence(self) -> None:
        with pytest.raises(KeyError):
            self.table.extend(-1, 1)

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.table.check()
        owned = {b for s in self.table.seq_ids for b in self.table.blocks(s)}
        assert self.table.usage().used == len(owned) == NUM_BLOCKS - self.table.num_free
        assert set(self.table.seq_ids) == set(self.model)

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq, tokens in self.model.items():
            assert self.table.length(seq) == len(tokens)
            assert self.cells[self.table.slots(seq)].tolist() == tokens

    def teardown(self) -> None:
        for seq in list(self.model):
            self.table.free(seq)
        assert self.table.num_free == NUM_BLOCKS, "blocks leaked"
        assert all(self.table.refcount(b) == 0 for b in range(NUM_BLOCKS))
        self.table.check()


BlockMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockMachine = BlockMachine.TestCase


def test_blocks_are_handed_out_lowest_first_and_slots_follow_the_table() -> None:
    """Blocks come lowest first and token t maps to blocks[t // bs] * bs + t % bs."""
    table = BlockTable(4, 2)
    table.add("a", 3)
    assert table.blocks("a") == [0, 1]
    assert table.slots("a").tolist() == [0, 1, 2]
    table.add("b", 1)
    assert table.extend("a", 2).tolist() == [3, 6]  # 3 in block 1, then a fresh block 3


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    """A fork raises full blocks' refcounts and asks for a copy of the partial last block."""
    table = BlockTable(8, 4)
    table.add("p", 6)
    copy = table.fork("p", "c")
    assert copy == ForkCopy(src=1, dst=2)
    assert table.blocks("c") == [0, 2]
    assert table.refcount(0) == 2 and table.refcount(1) == 1
    assert table.fork("c", "d") == ForkCopy(src=2, dst=3)
    table.free("p")
    table.free("c")
    assert table.refcount(0) == 1 and table.num_free == 6
    table.check()


def test_fork_of_a_block_aligned_sequence_copies_nothing() -> None:
    """A sequence ending on a block boundary forks without any copy or fresh block."""
    table = BlockTable(2, 4)
    table.add("p", 8)
    assert table.fork("p", "c") is None
    assert table.num_free == 0
    table.extend("p", 0)
    with pytest.raises(OutOfBlocksError):
        table.extend("c", 1)


def test_out_of_blocks_names_the_counts_and_changes_nothing() -> None:
    """OutOfBlocksError reports needed and free blocks; a batched grow is all-or-nothing."""
    table = BlockTable(3, 2)
    table.add("a", 2)
    table.add("b", 1)
    before = _snapshot(table)
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks but only 1"):
        table.extend_many({"a": 1, "b": 3})
    assert _snapshot(table) == before
    assert not table.can_grow({"a": 1, "b": 3}) and table.can_grow({"a": 1, "b": 1})


def test_bad_calls_raise_clear_errors() -> None:
    """Duplicate ids, unknown ids and negative counts are refused with their value named."""
    table = BlockTable(2, 2)
    table.add("a")
    with pytest.raises(ValueError, match="already exists"):
        table.add("a")
    with pytest.raises(KeyError, match="no sequence 'zz'"):
        table.free("zz")
    with pytest.raises(ValueError, match="num_tokens"):
        table.extend("a", -1)
    with pytest.raises(ValueError, match="already exists"):
        table.fork("a", "a")
