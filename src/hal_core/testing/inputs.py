"""Random op inputs (host numpy) and helpers to move them into a backend's memory domain.

Inputs are drawn so results are O(1), which is what the tolerance table
assumes. Memory an op must not read holds poison, so a backend that reads
it (even masked, since ``NaN * 0`` and ``NaN + -inf`` are NaN) fails:
block tables assign distinct blocks in random order and fill the entries
past each sequence's last block with garbage (-1, ``num_blocks + 5`` or
another block); every cache slot no sequence uses (past a length in its
last block, or in a block no sequence holds) is NaN; and the cache slots
``write_kv_cache`` does not write are NaN too, which must survive as they are.
The builders live with their ops (:mod:`hal_core.ops`); they are gathered here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import OPS
from ..ops.fused_moe import fused_moe_inputs
from ..ops.gated_activation import gated_activation_inputs
from ..ops.paged_attention import paged_attention_inputs
from ..ops.quantized_gemm import quantized_gemm_inputs
from ..ops.rms_norm import rms_norm_inputs
from ..ops.rotary_embedding import rotary_embedding_inputs
from ..ops.sample import sample_inputs
from ..ops.write_kv_cache import write_kv_cache_inputs
from .tolerances import tolerance

__all__ = [
    "assert_close",
    "fused_moe_inputs",
    "gated_activation_inputs",
    "paged_attention_inputs",
    "quantized_gemm_inputs",
    "sample_inputs",
    "rms_norm_inputs",
    "rotary_embedding_inputs",
    "to_backend",
    "write_kv_cache_inputs",
]


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
