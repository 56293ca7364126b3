"""Numeric arguments: numpy scalars and 0-d arrays work where a Python number does; bools and junk do not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core import ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import paged_attention_inputs


def _attention(cpu: Any, scale: Any) -> tuple[np.ndarray, dict[str, Any]]:
    rng = np.random.default_rng(8)
    args = paged_attention_inputs(rng, seq_lens=[9, 30], num_heads=4, num_kv_heads=2, head_size=64,
                                  block_size=8, dtype="fp32")
    out = cpu.ops.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                  args["seq_lens"], scale=scale)
    return out, args


@pytest.mark.parametrize("scale", [0.125, np.float32(0.125), np.float64(0.125), np.array(0.125), np.array(0.125,
                                   np.float16), 1, np.int64(1)],
                         ids=["float", "np.float32", "np.float64", "0-d", "0-d-fp16", "int", "np.int64"])
def test_paged_attention_scale_takes_numpy_numbers(cpu: Any, scale: Any) -> None:
    """scale may be any real Python or numpy scalar or a 0-d real array; the result is the reference's."""
    out, args = _attention(cpu, scale)
    expected = OPS["paged_attention"].reference({**args, "scale": float(scale)})
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [True, np.bool_(False), "0.125", None, np.array([0.125]), float("nan"),
                                   np.array(np.inf), 1j],
                         ids=["bool", "np.bool", "str", "None", "1-d", "nan", "0-d-inf", "complex"])
def test_paged_attention_scale_refuses_non_reals(cpu: Any, scale: Any) -> None:
    """Bools, strings, arrays with dimensions, non-finite and complex scales are refused naming 'scale'."""
    with pytest.raises(ArgumentTypeError, match="'scale'"):
        _attention(cpu, scale)
