"""Random op inputs (host numpy) and helpers to move them into a backend's memory domain.

Inputs are drawn so results are O(1), which is what the tolerance table
assumes. Memory an op must not read holds poison, so a backend that reads
it (even masked, since ``NaN * 0`` and ``NaN + -inf`` are NaN) fails:
block tables assign distinct blocks in random order and fill the entries
past each sequence's last block with garbage (-1, ``num_blocks + 5`` or
another block); every cache slot no sequence uses (past a length in its
last block, or in a block no sequence holds) is NaN; and the cache slots
``write_kv_cache`` does not write are NaN too, which must survive as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..ops import OPS
from ..quant import QuantizedWeight, quantize
from .tolerances import tolerance

__all__ = [
    "assert_close",
    "paged_attention_inputs",
    "quantized_gemm_inputs",
    "to_backend",
    "write_kv_cache_inputs",
]


def paged_attention_inputs(
    rng: np.random.Generator,
    *,
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: str,
    spare_blocks: int = 2,
) -> dict[str, Any]:
    """Host arguments of ``paged_attention`` for these sequence lengths."""
    lens = np.asarray(seq_lens, dtype=np.int32).reshape(-1)
    num_seqs = lens.size
    needed = -(-lens.astype(np.int64) // block_size)
    max_blocks = int(needed.max(initial=0)) + int(rng.integers(0, 3))
    num_blocks = max(1, int(needed.sum()) + spare_blocks)
    order = rng.permutation(num_blocks)
    shape = (num_seqs, max(1, max_blocks))
    garbage = np.stack([np.full(shape, -1), np.full(shape, num_blocks + 5), rng.integers(0, num_blocks, shape)])
    tables = np.take_along_axis(garbage, rng.integers(0, 3, (1, *shape)), axis=0)[0].astype(np.int32)
    np_dtype = numpy_dtype(dtype)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    value_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    unused = np.ones((num_blocks, block_size), dtype=bool)  # slots no sequence reads
    starts = np.concatenate([[0], np.cumsum(needed)])
    for s in range(num_seqs):  # test-input construction, not a kernel
        blocks = order[starts[s] : starts[s + 1]]
        tables[s, : needed[s]] = blocks
        unused.reshape(-1)[(blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[: lens[s]]] = False
    for cache in (key_cache, value_cache):
        cache.transpose(0, 2, 1, 3)[unused] = np.nan
    return {
        "query": rng.standard_normal((num_seqs, num_heads, head_size)).astype(np_dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables,
        "seq_lens": lens,
        "scale": float(1.0 / np.sqrt(head_size)),
    }


def write_kv_cache_inputs(
    rng: np.random.Generator,
    *,
    num_tokens: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: str,
    skip_fraction: float = 0.25,
) -> dict[str, Any]:
    """Host arguments of ``write_kv_cache``: distinct slots, some negative (skipped); unwritten slots NaN."""
    capacity = num_blocks * block_size
    if num_tokens > capacity:
        raise ValueError(f"num_tokens={num_tokens} exceeds the cache's {capacity} slots")
    slots = rng.permutation(capacity)[:num_tokens].astype(np.int64)
    slots[rng.random(num_tokens) < skip_fraction] = -1
    np_dtype = numpy_dtype(dtype)
    token_shape = (num_tokens, num_kv_heads, head_size)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    value_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    unwritten = np.ones(capacity, dtype=bool)
    unwritten[slots[slots >= 0]] = False
    for cache in (key_cache, value_cache):
        cache.transpose(0, 2, 1, 3)[unwritten.reshape(num_blocks, block_size)] = np.nan
    return {
        "key": rng.standard_normal(token_shape).astype(np_dtype),
        "value": rng.standard_normal(token_shape).astype(np_dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": slots.astype(np.int32 if rng.random() < 0.5 else np.int64),
    }


def quantized_gemm_inputs(
    rng: np.random.Generator,
    *,
    m: int,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    dtype: str,
    act_order: bool = False,
) -> dict[str, Any]:
    """Host arguments of ``quantized_gemm``: ``x`` in [-1, 1], weights ~ N(0, 1/K), quantised."""
    x = rng.uniform(-1.0, 1.0, size=(m, k)).astype(numpy_dtype(dtype))
    weight = rng.standard_normal((k, n)) / np.sqrt(k)
    qweight: QuantizedWeight = quantize(weight, bits=bits, group_size=group_size, symmetric=symmetric)
    if act_order:
        g_idx = rng.permutation(np.arange(k) // group_size).astype(np.int32)
        qweight = QuantizedWeight(qweight.qweight, qweight.scales, qweight.zeros, qweight.bits,
                                  qweight.group_size, qweight.shape, g_idx=g_idx)
    return {"x": x, "qweight": qweight}


def to_backend(backend: Any, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` of ``op`` with every array (quantized weights included) moved by ``backend.asarray``."""
    return OPS[op].map_arrays(args, backend.asarray)


def assert_close(actual: Any, expected: np.ndarray, *, kind: str, dtype: str, what: str = "result") -> None:
    """Assert ``actual`` (host numpy) matches the float64 ``expected`` within the tolerance table.

    Where ``expected`` is NaN (poison an op must leave as it is, or NaN an
    input propagates) ``actual`` must be NaN too, and where it is an
    infinity the same infinity; everywhere else it must be finite.
    """
    atol, rtol = tolerance(kind, dtype)
    got = np.asarray(actual).astype(np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    nan = np.isnan(expected)
    assert np.isnan(got[nan]).all(), (
        f"{what}: {int((~np.isnan(got[nan])).sum())} of {int(nan.sum())} elements the reference has NaN are not NaN "
        f"(first at {_first(nan & ~np.isnan(got))})"
    )
    inf = np.isinf(expected)
    assert (got[inf] == expected[inf]).all(), (
        f"{what}: {int((got[inf] != expected[inf]).sum())} elements the reference has infinite differ "
        f"(first at {_first(inf & (got != expected))})"
    )
    special = nan | inf
    assert np.isfinite(got[~special]).all(), (
        f"{what}: {int((~np.isfinite(got[~special])).sum())} non-finite values where the reference is finite "
        f"(first at {_first(~special & ~np.isfinite(got))})"
    )
    got, expected = np.where(special, 0.0, got), np.where(special, 0.0, expected)
    error = np.abs(got - expected)
    bound = atol + rtol * np.abs(expected)
    if not (error <= bound).all():
        worst = np.unravel_index(int(np.argmax(error - bound)), error.shape)
        raise AssertionError(
            f"{what} ({dtype}, {kind}: atol={atol}, rtol={rtol}) differs from the float64 reference: "
            f"max abs error {error.max():.3g}; worst at {tuple(int(i) for i in worst)}: "
            f"got {got[worst]:.6g}, expected {expected[worst]:.6g}; "
            f"{int((error > bound).sum())} of {error.size} elements out of tolerance"
        )


def _first(mask: np.ndarray) -> tuple[int, ...] | None:
    hits = np.argwhere(mask)
    return tuple(int(i) for i in hits[0]) if hits.size else None
