"""The int8 tensor-core GEMM (W4A8 and W8A8 on ``mma.m16n8k32.s8``) on a real GPU (skipped without one, with the
probe's reason; devices below sm_80 skip: they do not declare W4A8).

Against hal's float64 W4A8/W8A8 reference ``sx * (xq @ w)`` within docs/quantization.md's bound (the integer
group sums are exact; only float32 rounding and the output dtype's are allowed), against the float64 W4A16
product within the activation-rounding bound, run-to-run bits, NaN rows, and ``activations='auto'`` choosing
W4A8 on the GPU itself (``HAL_STRICT=1``: a fallback would raise).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize, quantize_activations

NP_DTYPES: dict[str, Any] = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
OUT_ROUNDOFF = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}
OUT_TINY = {"fp32": 2.0**-149, "fp16": 2.0**-24, "bf16": 2.0**-133}


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The CUDA backend under HAL_STRICT=1, on a device with the int8 MMA (it declares 'w4a8')."""
    monkeypatch.setenv("HAL_STRICT", "1")
    if "w4a8" not in (cuda_backend.ops.coverage("quantized_gemm").allowed.get("schemes") or ()):
        pytest.skip(f"{cuda_backend.device(0).capabilities.arch}: W4A8 needs the int8 tensor-core MMA (sm_80+)")
    return cuda_backend


def _reference(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    args = {"x": x, "qweight": qw, **({"activations": "int8"} if qw.bits == 4 else {})}
    return np.asarray(OPS["quantized_gemm"].reference(args))


def _bound(x: np.ndarray, qw: QuantizedWeight, dtype: str) -> np.ndarray:
    """``(2 groups + 2) 2**-24 sx (|xq| @ |w|)`` of float32 rounding, then the output dtype's rounding."""
    xq, sx = quantize_activations(x)
    w = qw.dequantize(np.float64)
    groups = qw.shape[0] // qw.group_size
    f32 = (2 * groups + 2) * 2.0**-24 * sx.astype(np.float64)[:, None] * (np.abs(xq.astype(np.float64)) @ np.abs(w))
    return f32 + OUT_ROUNDOFF[dtype] * (np.abs(_reference(x, qw)) + f32) + OUT_TINY[dtype]


def _gemm(be: Any, x: np.ndarray, qw: QuantizedWeight, **kw: Any) -> np.ndarray:
    return np.asarray(be.to_numpy(be.ops.quantized_gemm(be.asarray(x), qw.map_arrays(be.asarray), **kw)))


@pytest.mark.parametrize("m", [1, 7, 64, 130], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A8", "W8A8"])
def test_int8_mma_within_the_exact_reference_bound(be: Any, rng: np.random.Generator, bits: int, dtype: str,
                                                   m: int) -> None:
    """Every output within the documented float32 bound of float64 ``sx * (xq @ w)``; two runs, the same bits."""
    k, n = 2048, 1032
    qw = quantize(rng.standard_normal((k, n)) * 0.05, bits=bits, group_size=128, symmetric=False,
                  scale_dtype=np.float16)
    x = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    kw = {"activations": "int8"} if bits == 4 else {}
    first = _gemm(be, x, qw, **kw)
    err = np.abs(first.astype(np.float64) - _reference(x, qw))
    assert (err <= _bound(x, qw, dtype)).all(), f"max error {err.max():.3e}"
    second = _gemm(be, x, qw, **kw)
    np.testing.assert_array_equal(first.view(np.uint8), second.view(np.uint8))


def test_w4a8_within_activation_rounding_of_float64_w4a16(be: Any, rng: np.random.Generator) -> None:
    """Against x @ dequantize(w) in float64: within ``sx / 2 * sum_k |w|`` plus rounding, and not equal to it."""
    qw = quantize(rng.standard_normal((1024, 520)) * 0.05, bits=4, group_size=64, scale_dtype=np.float16)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    out = _gemm(be, x, qw, activations="int8").astype(np.float64)
    w = qw.dequantize(np.float64)
    _, sx = quantize_activations(x)
    err = np.abs(out - x.astype(np.float64) @ w)
    assert (err <= sx.astype(np.float64)[:, None] / 2 * np.abs(w).sum(axis=0) + _bound(x, qw, "fp32")).all()
    assert err.max() > 0


def test_auto_picks_w4a8_on_the_gpu(be: Any, rng: np.random.Generator) -> None:
    """activations='auto': W4A16 for one row, W4A8 from two, both on the GPU (strict mode: no fallback)."""
    qw = quantize(rng.standard_normal((512, 256)) * 0.05, bits=4, group_size=64, scale_dtype=np.float16)
    dqw = qw.map_arrays(be.asarray)
    assert be.ops.prepare("quantized_gemm", x=be.asarray(np.zeros((1, 512), np.float16)), qweight=dqw,
                          activations="auto").args["activations"] == "float"
    x = rng.standard_normal((4, 512)).astype(np.float16)
    assert be.ops.prepare("quantized_gemm", x=be.asarray(x), qweight=dqw,
                          activations="auto").args["activations"] == "int8"
    out = _gemm(be, x, qw, activations="auto")
    err = np.abs(out.astype(np.float64) - _reference(x, qw))
    assert (err <= _bound(x, qw, "fp16")).all()


def test_w4a8_nan_row(be: Any, rng: np.random.Generator) -> None:
    """A NaN in an activation row gives a NaN output row; the other rows are unaffected."""
    qw = quantize(rng.standard_normal((1024, 512)) * 0.05, bits=4, group_size=64, scale_dtype=np.float16)
    x = rng.standard_normal((4, 1024)).astype(np.float16)
    x[2, 17] = np.nan
    out = _gemm(be, x, qw, activations="int8").astype(np.float64)
    assert np.isnan(out[2]).all()
    keep = [0, 1, 3]
    assert (np.abs(out[keep] - _reference(x[keep], qw)) <= _bound(x[keep], qw, "fp16")).all()
