"""Numerics of the W8A8 path that flush-to-zero and NaN inputs could break, on host-compiled kernels.

GPU builds compile with ``-ftz=true`` (CuPy's default): float32 subnormal operands and results become 0.  The
host builds here with ``HAL_HOST_FTZ=1`` run the kernels with the CPU's flush-to-zero and denormals-are-zero
modes on, which treats float32 subnormals the same way, so the activation quantiser must still give exactly
``hal_core.quant.quantize_activations``'s scales and codes for rows of subnormals.  A NaN anywhere in an
activation row makes that row's scale, and so its GEMM output row, NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from hal_cupy._tc_pack import pack_weight
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from host_compiled.harness import HostKernelBuilder

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import quantize, quantize_activations
from hal_core.testing.tolerances import tolerance

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}


def _subnormal_rows(host_rng: np.random.Generator, dtype: str, m: int, k: int) -> np.ndarray:
    """Rows whose magnitudes make max|x| / 127 (and often x itself) float32-subnormal."""
    x = np.zeros((m, k), np.float32)
    for i in range(m):
        exponent = host_rng.integers(-149, -118)  # amax from the smallest subnormal to just above 127 * 2^-126
        x[i] = (host_rng.standard_normal(k) * 2.0 ** float(exponent)).astype(np.float32)
    x[0] = 0
    x[0, 3] = np.float32(2.0**-149)  # one smallest subnormal: the floor
    x[1, :4] = (np.float32(2.0**-126), np.float32(-(2.0**-127)), np.float32(3 * 2.0**-149), 0)
    if dtype == "fp32":
        return x
    # 16-bit dtypes: bf16 keeps float32's exponent range; fp16's subnormals are normal floats -- scale them down
    # only as far as fp16 can hold them.
    return x.astype(BFLOAT16) if dtype == "bf16" else (x.astype(np.float64) * 2.0**130).astype(np.float16)


@pytest.mark.parametrize("ftz", [True, False], ids=["ftz", "ieee"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_quantize_rows_of_subnormals_survive_flush_to_zero(host_builder: HostKernelBuilder,
                                                          host_rng: np.random.Generator, dtype: str,
                                                          ftz: bool) -> None:
    m, k = 6, 300
    x = _subnormal_rows(host_rng, dtype, m, k)
    spec = qg_rules.quant_util_spec(DTYPE_CODES[dtype])
    util = host_builder.build(spec.source, {**dict(spec.defines), "HAL_HOST_FTZ": int(ftz)})
    util.seed(int(host_rng.integers(1, 2**63)))
    xq = np.full((m, k), 99, np.int8)
    sx = np.full(m, np.nan, np.float32)
    util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, 1), xq, sx, x, k)
    ref_xq, ref_sx = quantize_activations(x)
    np.testing.assert_array_equal(sx.view(np.uint32), ref_sx.view(np.uint32))
    assert (sx > 0).all()
    np.testing.assert_array_equal(xq, ref_xq)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_w8a8_nan_row_gives_nan_row(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str) -> None:
    """quantize_rows gives a NaN row a NaN scale; the tensor-core GEMM then writes a NaN output row, the rest exact."""
    m, k, n = 5, 256, 132
    qw = quantize(host_rng.standard_normal((k, n)) / np.sqrt(k), bits=8, group_size=64, symmetric=False)
    x = host_rng.standard_normal((m, k))
    x[3, 100] = np.nan
    x = x.astype(NUMPY_DTYPES[dtype])
    util_spec = qg_rules.quant_util_spec(DTYPE_CODES[dtype])
    util = host_builder.build(util_spec.source, dict(util_spec.defines))
    gemm_spec = qg_rules.quant_gemm_tc_spec(DTYPE_CODES[dtype], 8, qg_rules.quant_gemm_tc_m_frags(m))
    gemm = host_builder.build(gemm_spec.source, dict(gemm_spec.defines))
    xq = np.zeros((m, k), np.int8)
    sx = np.zeros(m, np.float32)
    util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, 1), xq, sx, x, k)
    assert np.isnan(sx[3]) and np.isfinite(np.delete(sx, 3)).all()
    packed = pack_weight(qw)
    launch, ksplit, per_split = qg_rules.quant_gemm_tc_launch(8, m, n, k, 64, 1)
    assert ksplit == 1
    out = np.zeros((m, n), NUMPY_DTYPES[dtype])
    gemm.launch(launch, out, None, xq, sx, packed.qtc, packed.scales, packed.zeros, m, n, k, 64, per_split)
    out64 = out.astype(np.float64)
    assert np.isnan(out64[3]).all()
    keep = [0, 1, 2, 4]
    expected = OPS["quantized_gemm"].reference({"x": x[keep], "qweight": qw})
    atol, rtol = tolerance("gemm", dtype)
    np.testing.assert_allclose(out64[keep], expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "kernel"), [("bf16", "tensor_core"), ("bf16", "simt"), ("fp32", "simt")])
def test_w8a8_gemm_of_subnormal_scale_rows_survives_flush_to_zero(host_builder: HostKernelBuilder,
                                                                  host_rng: np.random.Generator, dtype: str,
                                                                  kernel: str) -> None:
    """Rows whose scale max|x| / 127 is float32-subnormal (bf16 and fp32 reach that range, fp16 does not; fp32 runs
    the SIMT kernel only): with
    flush-to-zero on, the GEMM epilogue must still multiply by that scale, not by 0 -- the outputs of such rows
    are normal float32 here, so they match the float64 reference relatively."""
    m, k, n, g = 4, 256, 132, 64
    # Large weights (fp16 scales near 2^12) so that sx * (xq @ w) is normal although sx is subnormal.
    qw = quantize(host_rng.standard_normal((k, n)) * 2.0**16 / np.sqrt(k), bits=8, group_size=g, symmetric=False)
    x = np.zeros((m, k))
    for i, exponent in enumerate((-124, -128, -131, 0)):  # sx = amax / 127: subnormal for rows 0-2, row 3 normal
        x[i] = host_rng.standard_normal(k) * 2.0**exponent
    x = x.astype(NUMPY_DTYPES[dtype])
    code = DTYPE_CODES[dtype]
    util_spec = qg_rules.quant_util_spec(code)
    util = host_builder.build(util_spec.source, {**dict(util_spec.defines), "HAL_HOST_FTZ": 1})
    util.seed(int(host_rng.integers(1, 2**63)))
    xq = np.zeros((m, k), np.int8)
    sx = np.zeros(m, np.float32)
    util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, 1), xq, sx, x, k)
    assert ((sx.view(np.uint32) & 0x7F800000) == 0)[:3].all(), "rows 0-2 must have subnormal scales"
    out = np.full((m, n), np.nan, NUMPY_DTYPES[dtype])
    if kernel == "tensor_core":
        spec = qg_rules.quant_gemm_tc_spec(code, 8, qg_rules.quant_gemm_tc_m_frags(m))
        packed = pack_weight(qw)
        launch, ksplit, per_split = qg_rules.quant_gemm_tc_launch(8, m, n, k, g, 1)
        weights = (packed.qtc, packed.scales, packed.zeros)
    else:
        spec = qg_rules.quant_gemm_spec(code, 8, qg_rules.quant_gemm_m_tile(m))
        launch, ksplit, per_split = qg_rules.quant_gemm_launch(8, m, n, k, g, 1)
        weights = (qw.qweight, qw.scales, qw.zeros)
    assert ksplit == 1
    gemm = host_builder.build(spec.source, {**dict(spec.defines), "HAL_HOST_FTZ": 1})
    gemm.seed(int(host_rng.integers(1, 2**63)))
    gemm.launch(launch, out, None, xq, sx, *weights, m, n, k, g, per_split)
    # The GEMM of the kernel-quantised activations, in float64: xq and sx are bit-exact (tested above).
    own = sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ qw.dequantize(np.float64))
    assert (np.abs(own[:3]) >= 2.0**-120).mean() > 0.9, "the test needs (mostly) normal float32 outputs"
    rtol = 2.0**-7 if dtype == "bf16" else 1e-4
    # float32 sums of four group partials: where they cancel, the rounding is relative to the partials, not to
    # the result, so the bound also allows a few float32 ulps of sx * (|xq| @ |w|), what the partials add up to
    partials = sx.astype(np.float64)[:, None] * (np.abs(xq.astype(np.float64)) @ np.abs(qw.dequantize(np.float64)))
    # the smallest normal float32, far below these rows' outputs (a flushed scale gives 0 and fails)
    bound = rtol * np.abs(own) + 2.0**-20 * partials + 2.0**-126
    error = np.abs(out.astype(np.float64) - own)
    worst = np.unravel_index((error / bound).argmax(), error.shape)
    assert (error <= bound).all(), f"error {error[worst]:.3g} above its bound {bound[worst]:.3g} at {worst}"
