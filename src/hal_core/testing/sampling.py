"""Checks of ``sample`` results shared by the contract suite and the backends' kernel tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import OPS
from ..ops._sampling import kept_weights, uniform_of_seed
from .inputs import to_backend

__all__ = ["BOUNDARY", "assert_same_tokens", "kept_weights", "run_sample", "uniform_of_seed"]

REFERENCE = OPS["sample"].reference
_OPTIONAL = ("top_k", "top_p", "min_p")
#: How close (relative to the kept mass) the reference's ``u * mass`` may lie to a CDF boundary for another
#: backend's float32 sums to pick the neighbouring token.
BOUNDARY = 1e-6


def run_sample(backend: Any, args: dict[str, Any]) -> np.ndarray:
    """``backend.ops.sample`` on ``args`` moved to the backend, as host int64."""
    dev = to_backend(backend, "sample", args)
    got = backend.ops.sample(dev["logits"], dev["temperature"], dev["seeds"],
                             **{n: dev[n] for n in _OPTIONAL if dev.get(n) is not None})
    return np.asarray(backend.to_numpy(got))


def _row_params(args: dict[str, Any], r: int) -> tuple[float, int, float, float]:
    top_k, top_p, min_p = (args.get(n) for n in _OPTIONAL)
    return (float(args["temperature"][r]), int(top_k[r]) if top_k is not None else 0,
            float(top_p[r]) if top_p is not None else 1.0, float(min_p[r]) if min_p is not None else 0.0)


def assert_same_tokens(got: np.ndarray, args: dict[str, Any]) -> None:
    """``got`` is the reference's token on every row, or one whose CDF interval is within BOUNDARY of its ``u``."""
    expected = REFERENCE(args)
    assert got.dtype == np.int64 and got.shape == expected.shape
    logits = np.asarray(args["logits"]).astype(np.float64)
    for r in np.flatnonzero(got != expected):
        weights = kept_weights(logits[r], *_row_params(args, int(r)))
        assert weights is not None and 0 <= got[r] < weights.size, f"row {r}: got {got[r]}, expected {expected[r]}"
        cdf = np.cumsum(weights)
        target = uniform_of_seed(int(args["seeds"][r])) * cdf[-1]
        low, high = cdf[got[r]] - weights[got[r]], cdf[got[r]]
        distance = max(low - target, target - high, 0.0)
        assert weights[got[r]] > 0 and distance <= BOUNDARY * cdf[-1], (
            f"row {r}: got token {got[r]} (CDF [{low}, {high})), the reference draws {expected[r]} at {target}")
