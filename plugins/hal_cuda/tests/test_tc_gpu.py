"""The tensor-core quantized GEMM and the K-slab path on a real GPU (skipped without one, with the probe's reason).

On sm_80+ the op routes fp16/bf16 activations to ``quant_gemm_tc.cu``; these tests check it against the float64
reference, that two runs give the same bits (no atomics), that a NaN row stays a NaN row, and the K-slab path
(``HAL_CUDA_TENSOR_CORES=0``, large M) with several slabs.  Devices below sm_80 skip the tensor-core tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import quantize

NP_DTYPES = {"fp16": np.float16, "bf16": BFLOAT16}
TOL = {"fp16": 2e-3, "bf16": 1.5e-2}


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


@pytest.fixture
def tc_be(be: Any) -> Any:
    from hal_cupy.ops._quantized_gemm import uses_tensor_cores

    if not uses_tensor_cores(be, 0, "fp16", 4, 1):
        pytest.skip(f"{be.device(0).capabilities.arch}: the tensor-core kernels need sm_80+")
    return be


def _case(rng: np.random.Generator, m: int, k: int, n: int, dtype: str, **quant: Any) -> tuple[np.ndarray, Any]:
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.05, **quant)
    return rng.standard_normal((m, k)).astype(NP_DTYPES[dtype]), qw


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64 = np.asarray(out, np.float64)
    assert np.isfinite(out64).all(), "non-finite output (an element left unwritten?)"
    return float(np.linalg.norm(out64 - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("m", [1, 7, 16, 64, 128], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_tensor_core_gemm_matches_reference_and_repeats(tc_be: Any, rng: np.random.Generator, bits: int,
                                                        dtype: str, m: int) -> None:
    x, qw = _case(rng, m, 4096, 4096 + 136, dtype, bits=bits, group_size=128, symmetric=False)
    dqw, dx = qw.map_arrays(tc_be.asarray), tc_be.asarray(x)
    first = tc_be.to_numpy(tc_be.ops.quantized_gemm(dx, dqw))
    second = tc_be.to_numpy(tc_be.ops.quantized_gemm(dx, dqw))
    assert _rel_err(first, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < 2 * TOL[dtype]
    np.testing.assert_array_equal(first.view(np.uint16), second.view(np.uint16))  # the same bits every run


@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_tensor_core_nan_row(tc_be: Any, rng: np.random.Generator, bits: int) -> None:
    x, qw = _case(rng, 4, 1024, 512, "fp16", bits=bits, group_size=64)
    x[2, 17] = np.nan
    out = tc_be.to_numpy(tc_be.ops.quantized_gemm(tc_be.asarray(x), qw.map_arrays(tc_be.asarray)))
    assert np.isnan(out[2].astype(np.float64)).all()
    keep = [0, 1, 3]
    assert _rel_err(out[keep], OPS["quantized_gemm"].reference(dict(x=x[keep], qweight=qw))) < 2 * TOL["fp16"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_k_slab_path(be: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, bits: int,
                     dtype: str) -> None:
    """Large M without tensor cores: several dequantised K-slabs accumulated by cuBLAS with beta = 1."""
    from hal_cupy.ops import _quantized_gemm as qg

    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    monkeypatch.setattr(qg, "QGEMM_SLAB_BYTES", 1 << 20)  # 1 MiB slabs: several for this shape
    x, qw = _case(rng, 300, 2048, 1024, dtype, bits=bits, group_size=128, symmetric=False)
    assert qg.slab_rows(2048, 1024, 128, 2, qg.QGEMM_SLAB_BYTES) < 2048
    out = be.to_numpy(be.ops.quantized_gemm(be.asarray(x), qw.map_arrays(be.asarray)))
    assert _rel_err(out, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < 2 * TOL[dtype]
