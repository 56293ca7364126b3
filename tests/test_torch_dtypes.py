"""hal's one map between its dtype names and torch's dtypes agrees with numpy's names and with torch itself."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hal_core.arrays import DTYPE_NAMES, numpy_dtype  # noqa: E402
from hal_core.torch import FLOAT_DTYPE_NAMES  # noqa: E402
from hal_core.torch._dtypes import TORCH_DTYPES  # noqa: E402


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_each_name_is_the_same_dtype_in_numpy_and_torch(name: str) -> None:
    """Width, kind and signedness agree, and a value round-trips bit for bit through a tensor's bytes."""
    dtype, np_dtype = TORCH_DTYPES[name], numpy_dtype(name)
    assert DTYPE_NAMES[np_dtype] == name
    assert dtype.itemsize == np_dtype.itemsize
    assert dtype.is_floating_point == (np_dtype.kind == "f" or name == "bf16")
    assert dtype.is_signed == (np_dtype.kind != "u")
    values = np.array([0, 1, 2, 3, 100, -1 if np_dtype.kind != "u" else 5], dtype=np_dtype)
    raw = torch.frombuffer(bytearray(values.tobytes()), dtype=dtype)
    assert raw.to(torch.float64).tolist() == values.astype(np.float64).tolist()


def test_float_names_are_the_dtypes_the_ops_compute_in() -> None:
    """float32, float16 and bfloat16, named as the ops name them; float64 and the integers are not among them."""
    assert dict(FLOAT_DTYPE_NAMES) == {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    assert torch.float64 not in FLOAT_DTYPE_NAMES and torch.int32 not in FLOAT_DTYPE_NAMES
    with pytest.raises(TypeError):
        FLOAT_DTYPE_NAMES[torch.float64] = "fp64"  # type: ignore[index]
