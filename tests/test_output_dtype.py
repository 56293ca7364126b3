"""``Output(dtype=...)``: an op whose result has a fixed dtype (token ids) rather than an argument's."""

from __future__ import annotations

import numpy as np
import pytest

from hal_core.ops import OPS, Output


def test_output_takes_exactly_one_dtype_source() -> None:
    """Neither or both of dtype_of and dtype is refused when the op is declared."""
    with pytest.raises(ValueError, match="exactly one"):
        Output("[n]")
    with pytest.raises(ValueError, match="exactly one"):
        Output("[n]", dtype_of="x", dtype="int64")
    assert Output("[n]", dtype="int64").dtype == "int64"


def test_fixed_output_dtype_drives_the_result_and_the_out_check() -> None:
    """sample's result dtype is int64 whatever the logits' dtype, and its ``out`` accepts only int64."""
    spec = OPS["sample"]
    for dtype in (np.float32, np.float16):
        assert spec.output_dtype({"logits": np.zeros((2, 3), dtype)}) == np.dtype(np.int64)
    out = spec.arg_named("out")
    assert out.dtypes == ("int64",) and out.dtype_of is None
