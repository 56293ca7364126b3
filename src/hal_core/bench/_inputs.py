"""Host (numpy) inputs of a benchmark case, built fast (no float64 intermediates, no quantiser run).

Values are random but realistic in layout: attention block tables hand out
distinct blocks in random order, quantized weights hold random codes and
positive scales. Inputs are not checked against a reference here; the
contract suite does that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..quant import QuantizedWeight
from ._cases import Case

__all__ = ["build_inputs"]


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = rng.random(shape, dtype=np.float32)
    values -= 0.5
    return values.astype(numpy_dtype(dtype), copy=False)


def _attention(rng: np.random.Generator, p: dict[str, Any]) -> dict[str, Any]:
    seqs, ctx, block = p["seqs"], p["ctx"], p["block"]
    per_seq = -(-ctx // block)
    num_blocks = seqs * per_seq
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, per_seq)
    shape = (num_blocks, p["kv_heads"], block, p["head"])
    return {
        "query": _uniform(rng, (seqs, p["heads"], p["head"]), p["dtype"]),
        "key_cache": _uniform(rng, shape, p["dtype"]),
        "value_cache": _uniform(rng, shape, p["dtype"]),
        "block_tables": tables,
        "seq_lens": np.full(seqs, ctx, dtype=np.int32),
        "scale": float(1.0 / np.sqrt(p["head"])),
    }


def _write(rng: np.random.Generator, p: dict[str, Any]) -> dict[str, Any]:
    tokens, block = p["tokens"], p["block"]
    num_blocks = p["blocks"] or max(2 * -(-tokens // block), 64)
    shape = (num_blocks, p["kv_heads"], block, p["head"])
    slots = rng.permutation(num_blocks * block)[:tokens].astype(np.int64)
    return {
        "key": _uniform(rng, (tokens, p["kv_heads"], p["head"]), p["dtype"]),
        "value": _uniform(rng, (tokens, p["kv_heads"], p["head"]), p["dtype"]),
        "key_cache": np.zeros(shape, dtype=numpy_dtype(p["dtype"])),
        "value_cache": np.zeros(shape, dtype=numpy_dtype(p["dtype"])),
        "slot_mapping": slots,
    }


def random_weight(rng: np.random.Generator, k: int, n: int, bits: int, group: int) -> QuantizedWeight:
    """A symmetric group-wise weight with uniform random codes and scales in [0.001, 0.011)."""
    if bits == 4:
        packed = rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint32)
    else:
        packed = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
    scales = (rng.random((k // group, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
    return QuantizedWeight(qweight=packed, scales=scales, zeros=None, bits=bits, group_size=group, shape=(k, n))


def _gemm(rng: np.random.Generator, p: dict[str, Any]) -> dict[str, Any]:
    return {
        "x": _uniform(rng, (p["m"], p["k"]), p["dtype"]),
        "qweight": random_weight(rng, p["k"], p["n"], p["bits"], p["group"]),
    }


_BUILD = {"paged_attention": _attention, "write_kv_cache": _write, "quantized_gemm": _gemm}


def build_inputs(case: Case, rng: np.random.Generator) -> dict[str, Any]:
    """One set of host arguments for ``case``."""
    return _BUILD[case.op](rng, dict(case.params))
