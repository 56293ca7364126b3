"""``y[i] += a * x[i]`` as a host kernel (the CPU launcher's convention: ``kernel(ctx, *args)``)."""

from __future__ import annotations

from typing import Any

import numpy as np


def hal_test_axpy(ctx: Any, x: np.ndarray, y: np.ndarray, a: Any, n: Any) -> None:
    """Grid-stride loop, vectorised over the block's threads and its strides."""
    n = int(n)
    steps = -(-n // ctx.total_threads)
    index = (ctx.global_ids[None, :] + ctx.total_threads * np.arange(steps)[:, None]).ravel()
    index = index[index < n]
    y[index] += a * x[index]
