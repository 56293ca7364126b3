"""rms_norm and gated_activation on a GPU against the float64 references (skipped where no CUDA device is usable).

``HAL_STRICT=1``: a call that would fall back to the CPU path fails. Strided rows (a wider device array's
columns) go in as views; the residual holds the rounded sum bit-exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core.ops import OPS
from hal_core.ops.gated_activation import ACTIVATIONS
from hal_core.testing.inputs import assert_close, gated_activation_inputs, rms_norm_inputs


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


def _device_rows(be: Any, rows: np.ndarray) -> Any:
    """``rows`` on the device as the same view of a copy of its whole (C-contiguous) base array."""
    base = rows.base if rows.base is not None and rows.base.flags.c_contiguous else None
    if base is None or base.ndim != 2:
        return be.asarray(np.ascontiguousarray(rows))
    return be.asarray(base)[:, : rows.shape[1]]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("tokens", "hidden", "gap"), [(1, 4096, 0), (8, 2048, 8), (33, 131, 3), (512, 4096, 0)])
def test_rms_norm(be: Any, rng: np.random.Generator, dtype: str, tokens: int, hidden: int, gap: int) -> None:
    """The fused add-and-norm on the GPU: out within tolerance, residual bit-exact, strided x read in place."""
    args = rms_norm_inputs(rng, num_tokens=tokens, hidden_size=hidden, dtype=dtype, row_stride=hidden + gap)
    expected, expected_residual = OPS["rms_norm"].reference({**args, "weight_offset": 1.0})
    residual = be.asarray(args["residual"])
    out = be.ops.rms_norm(_device_rows(be, args["x"]), be.asarray(args["weight"]), epsilon=args["epsilon"],
                          residual=residual, weight_offset=1.0)
    assert_close(be.to_numpy(out), expected, kind="elementwise", dtype=dtype)
    assert expected_residual is not None
    assert_close(be.to_numpy(residual), expected_residual, kind="copy", dtype=dtype, what="residual")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 11008), (8, 5632), (5, 77)])
def test_gated_activation(be: Any, rng: np.random.Generator, activation: str, dtype: str, tokens: int,
                          inter: int) -> None:
    """act(gate) * up on the halves of one fused device array."""
    args = gated_activation_inputs(rng, num_tokens=tokens, intermediate_size=inter, dtype=dtype,
                                   activation=activation)
    both = be.asarray(np.concatenate([args["gate"], args["up"]], axis=1))
    out = be.ops.gated_activation(both[:, :inter], both[:, inter:], activation=activation)
    assert_close(be.to_numpy(out), OPS["gated_activation"].reference(args), kind="elementwise", dtype=dtype)
