"""The paged KV cache on a real backend: sizing, step arrays, and attention through it vs float64."""

from __future__ import annotations

import numpy as np
import pytest

from hal_core import OutOfBlocksError
from hal_core.arrays import numpy_dtype
from hal_core.kvcache import CacheConfig, PagedKVCache

TOL = {"fp32": 2e-5, "fp16": 4e-3, "bf16": 3e-2}
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def causal_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Plain float64 attention of query rows at ``positions`` over a logical sequence (no paging)."""
    group = q.shape[1] // keys.shape[1]
    out = np.zeros(q.shape)
    for i, p in enumerate(positions):
        k = np.repeat(keys[: p + 1].astype(np.float64), group, axis=1)
        v = np.repeat(values[: p + 1].astype(np.float64), group, axis=1)
        s = np.einsum("hd,nhd->hn", q[i].astype(np.float64), k) / np.sqrt(q.shape[-1])
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), v)
    return out


class Driver:
    """Runs steps through a cache and keeps every sequence's logical K/V per layer for the reference."""

    def __init__(self, cpu, cache: PagedKVCache, rng: np.random.Generator) -> None:
        self.be, self.cache, self.rng = cpu, cache, rng
        self.dtype = numpy_dtype(cache.config.dtype)
        self.logical: dict[object, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _rand(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(self.dtype)

    def step(self, new_tokens: dict[object, int]) -> float:
        """One step; returns the worst error of paged attention against the reference, over layers."""
        step = self.cache.prepare_step(new_tokens)
        worst = 0.0
        for layer in range(self.cache.config.num_layers):
            k, v = self._rand(step.num_tokens, NUM_KV_HEADS, HEAD_SIZE), self._rand(step.num_tokens, NUM_KV_HEADS,
                                                                                     HEAD_SIZE)
            q = self._rand(step.num_tokens, NUM_HEADS, HEAD_SIZE)
            kc, vc = self.cache.layer(layer)
            self.be.ops.write_kv_cache(self.be.asarray(k), self.be.asarray(v), kc, vc, step.slot_mapping)
            out = self.be.ops.paged_attention(self.be.asarray(q), kc, vc, scale=HEAD_SIZE**-0.5,
                                              **step.attention_args())
            out = self.be.to_numpy(out).astype(np.float64)
            for i, seq in enumerate(step.seq_ids):
                rows = step.row_seq == i
                layers = self.logical.setdefault(seq, [(np.zeros((0, NUM_KV_HEADS, HEAD_SIZE), self.dtype),) * 2
                                                       for _ in range(self.cache.config.num_layers)])
                lk, lv = layers[layer]
                layers[layer] = (np.concatenate([lk, k[rows]]), np.concatenate([lv, v[rows]]))
                want = causal_reference(q[rows], *layers[layer], step.positions[rows])
                worst = max(worst, float(np.abs(out[rows] - want).max()))
        return worst

    def fork(self, parent: object, child: object) -> None:
        self.cache.fork(parent, child)
        self.logical[child] = list(self.logical[parent])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_attention_through_the_cache_matches_float64(cpu, rng: np.random.Generator, dtype: str,
                                                     block_size: int) -> None:
    """Prefill, decode, join, fork and finish through the manager: attention equals the unpaged float64 one."""
    config = CacheConfig(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=block_size,
                         dtype=dtype)
    with PagedKVCache(cpu, config, num_blocks=40) as cache:
        d = Driver(cpu, cache, rng)
        for seq in ("a", "b", "c"):
            cache.add(seq)
        errors = [d.step({"a": 5, "b": 17, "c": 1})]  # prefill, mixed lengths, rows per token
        errors.append(d.step({"a": 1, "b": 1, "c": 1}))  # decode
        d.fork("b", "b2")  # 18 tokens: full blocks shared, the partial one copied
        cache.add("d")
        errors.append(d.step({"a": 1, "b": 1, "b2": 1, "d": 9}))  # a join while others decode
        cache.free("a")
        for _ in range(block_size + 1):  # cross block boundaries on both sides of the fork
            errors.append(d.step({"b": 1, "b2": 1, "c": 1, "d": 1}))
        assert max(errors) < TOL[dtype], errors
        cache.blocks.check()
        for seq in list(cache.blocks.seq_ids):
            cache.free(seq)
        assert cache.usage().used_blocks == 0


def test_fork_copies_only_the_partial_block_on_the_device(cpu, rng: np.random.Generator) -> None:
    """After a fork the child's copied block holds the parent's K/V and later writes do not leak across."""
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_size=64, block_size=4, dtype="fp32")
    cache = PagedKVCache(cpu, config, num_blocks=6)
    cache.add("p")
    step = cache.prepare_step({"p": 6})
    k = rng.standard_normal((6, 1, 64)).astype(np.float32)
    kc, vc = cache.layer(0)
    cpu.ops.write_kv_cache(k, k, kc, vc, step.slot_mapping)
    copy = cache.fork("p", "c")
    assert copy is not None and cache.blocks.blocks("c")[0] == cache.blocks.blocks("p")[0]
    kc_host = cpu.to_numpy(kc)
    np.testing.assert_array_equal(kc_host[copy.dst], kc_host[copy.src])
    child = cache.prepare_step({"c": 1})
    cpu.ops.write_kv_cache(np.ones((1, 1, 64), np.float32), np.ones((1, 1, 64), np.float32), kc, vc,
                           child.slot_mapping)
    kc_host = cpu.to_numpy(kc)
    assert kc_host[copy.dst, 0, 2].tolist() == [1.0] * 64
    assert kc_host[copy.src, 0, 2].tolist() != [1.0] * 64  # the parent's block is untouched
    assert cache.usage().shared_blocks == 1


def test_out_of_blocks_leaves_the_cache_unchanged(cpu) -> None:
    """A step needing more blocks than are free raises OutOfBlocksError and grows no sequence."""
    cache = PagedKVCache(cpu, CacheConfig(1, 1, 64, block_size=4, dtype="fp16"), num_blocks=3)
    cache.add("a")
    cache.add("b")
    cache.prepare_step({"a": 4, "b": 3})
    with pytest.raises(OutOfBlocksError) as info:
        cache.prepare_step({"a": 1, "b": 2})
    assert (info.value.needed, info.value.free) == (2, 1)
    assert (cache.blocks.length("a"), cache.blocks.length("b")) == (4, 3)
    cache.extend("a", 1)  # takes the last free block
    with pytest.raises(OutOfBlocksError):
        cache.fork("b", "b2")
    assert "b2" not in cache


def test_step_too_wide_for_max_blocks_leaves_the_cache_unchanged(cpu) -> None:
    """A step whose block tables would pass max_blocks raises ValueError and grows no sequence."""
    cache = PagedKVCache(cpu, CacheConfig(1, 1, 64, block_size=16, dtype="fp16"), num_blocks=8)
    cache.add("a")
    cache.add("b")
    cache.prepare_step({"a": 3, "b": 1})
    free = cache.usage().free_blocks
    with pytest.raises(ValueError, match="max_blocks=2"):
        cache.prepare_step({"b": 1, "a": 40}, max_blocks=2)
    assert (cache.blocks.length("a"), cache.blocks.length("b")) == (3, 1)
    assert cache.usage().free_blocks == free
    cache.blocks.check()
    step = cache.prepare_step({"a": 29, "b": 1}, max_blocks=2)  # exactly two blocks: fits
    assert cpu.to_numpy(step.block_tables).shape == (2, 2)


def test_step_arrays_are_device_arrays_of_the_op_dtypes(cpu) -> None:
    """slot_mapping is int64, the rest int32, in the backend's memory, one table row per sequence, padded as asked."""
    cache = PagedKVCache(cpu, CacheConfig(1, 1, 64, block_size=4, dtype="fp32"), num_blocks=8)
    cache.add("x")
    cache.add("y")
    step = cache.prepare_step({"x": 6, "y": 1}, max_blocks=5)
    for array, dtype in ((step.slot_mapping, np.int64), (step.block_tables, np.int32), (step.seq_lens, np.int32),
                         (step.query_start_loc, np.int32)):
        assert cpu.owns(array) and array.dtype == dtype
    assert cpu.to_numpy(step.block_tables).shape == (2, 5)
    assert cpu.to_numpy(step.seq_lens).tolist() == [6, 1]
    assert cpu.to_numpy(step.query_start_loc).tolist() == [0, 6, 7]
    assert (step.max_query_len, step.max_seq_len) == (6, 6)
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert step.last_rows.tolist() == [5, 6]
    assert cpu.to_numpy(cache.seq_lens(["y", "x"])).tolist() == [1, 6]
    assert cpu.to_numpy(cache.block_tables(["x", "y"])).tolist() == [[0, 1], [2, 0]]
    assert cpu.to_numpy(cache.slot_mapping("x", 4)).tolist() == [4, 5]


def test_sizing_from_memory_fraction_respects_granularity(cpu) -> None:
    """gpu_memory_utilization sizes the cache within the fraction of free memory, in granules."""
    config = CacheConfig(num_layers=3, num_kv_heads=2, head_size=64, block_size=16, dtype="fp16")
    n = PagedKVCache.blocks_for_memory(config, memory_free=10_000_000, memory_total=10**9, fraction=0.5,
                                       granularity=4096)
    per_cache = 5_000_000 // 6 // 4096 * 4096
    assert n == per_cache // config.block_bytes
    assert PagedKVCache.blocks_for_memory(config, None, 10_000_000, 0.5, 4096) == n  # total when free unknown
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        PagedKVCache.blocks_for_memory(config, None, 1, 1.5, 1)
    caps = cpu.device(0).capabilities
    fraction = 4 * 2**20 / (caps.memory_free or caps.memory_total)  # about 4 MiB of this machine
    with PagedKVCache(cpu, config, gpu_memory_utilization=fraction) as cache:
        usage = cache.usage()
        granularity = cpu.device(0).allocator.granularity
        assert usage.total_blocks > 0
        assert usage.bytes_allocated <= 4 * 2**20 + 6 * granularity
        assert usage.bytes_allocated >= usage.total_blocks * config.bytes_per_block
        assert all(buf.nbytes % granularity == 0 for buf in cache._buffers)
        cache.add("s", 20)
        assert cache.usage().bytes_used == 2 * config.bytes_per_block
    assert cache._buffers == []


def test_constructor_needs_exactly_one_size() -> None:
    """num_blocks and gpu_memory_utilization are exclusive; one is required."""
    with pytest.raises(ValueError, match="exactly one"):
        PagedKVCache(None, CacheConfig(1, 1, 64), num_blocks=4, gpu_memory_utilization=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        CacheConfig(1, 1, 64, dtype="fp8")
