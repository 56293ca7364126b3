"""Hypothesis settings and strategies shared by the op tests."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = ["DTYPES", "HEAD_SIZES", "BLOCK_SIZES", "GQA_RATIOS", "OP_SETTINGS", "seeds"]

DTYPES = ("fp32", "fp16", "bf16")
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
GQA_RATIOS = (1, 4, 8)

#: Few, varied examples: the suite must stay fast on a CPU; deadline off (first calls compile on GPUs).
OP_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: The seed of the numpy generator a Hypothesis example draws its values from.
seeds = st.integers(min_value=0, max_value=2**32 - 1)
