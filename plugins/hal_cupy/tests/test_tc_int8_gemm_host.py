"""The int8 tensor-core GEMM (``quant_gemm_tc.cu``: W4A8 and W8A8 on ``mma.m16n8k32.s8``), host-compiled.

The kernels run on the CPU through the host prelude, whose ``mma.sync`` / ``ldmatrix`` / ``cp.async`` emulation
follows the PTX fragment layouts (``test_tc_emulation.py``); activations are quantised by the device kernels
``hal_w4a8_quantize_rows`` / ``hal_w8a8_quantize_rows``, weights repacked by ``hal_cupy._tc_pack``, launches come
from the plugin's host rules.  Checked against hal's exact W4A8/W8A8 reference (float64 ``sx * (xq @ w)``)
within the documented float32 bound (docs/quantization.md, "W4A8 accuracy"), and W4A8 against the float64
W4A16 product within the activation-rounding bound.  Inputs are fresh each run (seed printed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hal_cupy._tc_pack import pack_weight
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize, quantize_activations

NUMPY_DTYPES: dict[str, Any] = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
#: Unit roundoff of the output dtype (the last rounding, float32 -> out) and its smallest subnormal.
OUT_ROUNDOFF = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}
OUT_TINY = {"fp32": 2.0**-149, "fp16": 2.0**-24, "bf16": 2.0**-133}
MANY_CUS, ONE_CU = 132, 1


def w4a8_column(k: int) -> int:
    """Where ``hal_w4a8_quantize_rows`` stores activation column ``k`` (independent restatement of the kernel's
    ``W4a8Column``): in each 32-column block, ``k = 16 a + 8 h + 2 t + e`` goes to ``16 h + 4 t + 2 e + a``."""
    block, b = divmod(k, 32)
    a, rest = divmod(b, 16)
    h, rest = divmod(rest, 8)
    t, e = divmod(rest, 2)
    return 32 * block + 16 * h + 4 * t + 2 * e + a


def _module(host_builder: HostKernelBuilder, spec: Any, host_rng: np.random.Generator) -> HostModule:
    module = host_builder.build(spec.source, dict(spec.defines))
    module.seed(int(host_rng.integers(1, 2**63)))
    return module


def _quantize(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str, x: np.ndarray,
              kernel: str) -> tuple[np.ndarray, np.ndarray]:
    m, k = x.shape
    util = _module(host_builder, qg_rules.quant_util_spec(DTYPE_CODES[dtype]), host_rng)
    xq = np.zeros((m, k), np.int8)
    sx = np.full(m, np.nan, np.float32)
    util.launch(qg_rules.quant_util_launch(kernel, m, MANY_CUS), xq, sx, x, k)
    return xq, sx


def _run(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str, qw: QuantizedWeight,
         x: np.ndarray, compute_units: int, shuffle_ctas: bool = False) -> tuple[np.ndarray, int]:
    """out = quantized_gemm(x, qw, activations='int8') through the int8 tensor-core kernels; (out, ksplit)."""
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    w4a8 = qw.bits == 4
    frags = qg_rules.quant_gemm_tc_m_frags(m)
    spec = qg_rules.quant_gemm_tc_spec(DTYPE_CODES[dtype], qw.bits, frags, int8_activations=True)
    gemm = _module(host_builder, spec, host_rng)
    assert gemm.static_shared_bytes() == qg_rules.quant_gemm_tc_shared_bytes(qw.bits, frags, int8_activations=True)
    xq, sx = _quantize(host_builder, host_rng, dtype, x, "hal_w4a8_quantize_rows" if w4a8 else
                       "hal_w8a8_quantize_rows")
    packed = pack_weight(qw)
    launch, ksplit, per_split = qg_rules.quant_gemm_tc_launch(qw.bits, m, n, k, g, compute_units,
                                                              int8_activations=True)
    assert launch.kernel == ("hal_w4a8_gemm_tc" if w4a8 else "hal_w8a8_gemm_tc")
    out = np.full((m, n), np.nan, NUMPY_DTYPES[dtype])
    ws = np.full((ksplit, m, n), np.nan, np.float32) if ksplit > 1 else None  # every partial must be written
    gemm.shuffle_ctas(shuffle_ctas)
    gemm.launch(launch, out, ws, xq, sx, packed.qtc, packed.scales, packed.zeros, m, n, k, g, per_split)
    gemm.shuffle_ctas(False)
    if ws is not None:
        assert np.isnan(out.astype(np.float32)).all(), "with a K split the GEMM leaves out to the reduction"
        gemm.launch(qg_rules.quant_gemm_tc_reduce_launch(m, n, compute_units), out, ws, m * n, ksplit)
    return out, ksplit


def _reference(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    args = {"x": x, "qweight": qw, **({"activations": "int8"} if qw.bits == 4 else {})}
    return np.asarray(OPS["quantized_gemm"].reference(args))


def _float32_bound(x: np.ndarray, qw: QuantizedWeight, dtype: str) -> np.ndarray:
    """docs/quantization.md's bound on a kernel against the exact W4A8/W8A8 reference: ``(2 groups + 2) 2**-24 sx
    (|xq| @ |w|)`` of float32 rounding, then the output dtype's rounding of the result."""
    xq, sx = quantize_activations(x)
    w = qw.dequantize(np.float64)
    groups = qw.shape[0] // qw.group_size
    f32 = (2 * groups + 2) * 2.0**-24 * sx.astype(np.float64)[:, None] * (np.abs(xq.astype(np.float64)) @ np.abs(w))
    ref = np.abs(_reference(x, qw))
    return f32 + OUT_ROUNDOFF[dtype] * (ref + f32) + OUT_TINY[dtype]


@dataclass(frozen=True)
class Case:
    bits: int
    dtype: str
    m: int
    n: int
    k: int
    group_size: int
    symmetric: bool
    compute_units: int
    split: bool  # what the host rule must choose

    @property
    def id(self) -> str:
        kind = "W4A8" if self.bits == 4 else "W8A8"
        return (f"{kind}-{self.dtype}-M{self.m}-N{self.n}-K{self.k}-G{self.group_size}-"
                f"{'sym' if self.symmetric else 'zeros'}-{'split' if self.split else 'noSplit'}")


CASES = [
    Case(4, "fp16", 1, 256, 1024, 128, False, MANY_CUS, True),
    Case(4, "bf16", 5, 132, 512, 32, True, MANY_CUS, True),  # N tail inside a 128-column tile
    Case(4, "fp32", 3, 200, 256, 64, False, ONE_CU, False),
    Case(4, "fp16", 16, 200, 256, 64, True, ONE_CU, False),
    Case(4, "bf16", 64, 128, 256, 128, False, ONE_CU, False),  # 4 fragments
    Case(4, "fp32", 130, 136, 256, 32, True, MANY_CUS, False),  # three 64-row chunks, the last of 2 rows
    Case(4, "bf16", 37, 260, 512, 64, False, MANY_CUS, True),  # rows past M zero-filled, 3 column tiles
    Case(4, "fp16", 3, 128, 1152, 128, False, MANY_CUS, True),  # stripes of 9 k-blocks split 4-block groups
    Case(8, "fp32", 1, 256, 512, 64, True, MANY_CUS, True),
    Case(8, "fp32", 33, 132, 256, 32, False, ONE_CU, False),
    Case(8, "bf16", 7, 200, 256, 128, False, MANY_CUS, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_int8_tc_gemm_matches_exact_reference(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                              case: Case) -> None:
    """The int8-MMA GEMM equals hal's float64 W4A8/W8A8 reference within the documented float32 bound."""
    qw = quantize(host_rng.standard_normal((case.k, case.n)) / np.sqrt(case.k), bits=case.bits,
                  group_size=case.group_size, symmetric=case.symmetric)
    x = host_rng.standard_normal((case.m, case.k)).astype(NUMPY_DTYPES[case.dtype])
    out, ksplit = _run(host_builder, host_rng, case.dtype, qw, x, case.compute_units)
    assert (ksplit > 1) == case.split
    err = np.abs(out.astype(np.float64) - _reference(x, qw))
    bound = _float32_bound(x, qw, case.dtype)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{case.id}: error {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_w4a8_tc_within_activation_rounding_of_float64_w4a16(host_builder: HostKernelBuilder,
                                                              host_rng: np.random.Generator, dtype: str) -> None:
    """Against the float64 W4A16 product of the same weight: within ``sx / 2 * sum_k |w|`` plus the float32 and
    output rounding (docs/quantization.md), and not equal to it (the activations really are int8)."""
    k, n = 512, 136
    qw = quantize(host_rng.standard_normal((k, n)) / np.sqrt(k), bits=4, group_size=64, symmetric=False)
    x = host_rng.standard_normal((9, k)).astype(NUMPY_DTYPES[dtype])
    out, _ = _run(host_builder, host_rng, dtype, qw, x, MANY_CUS)
    w = qw.dequantize(np.float64)
    w4a16 = x.astype(np.float64) @ w
    _, sx = quantize_activations(x)
    bound = sx.astype(np.float64)[:, None] / 2 * np.abs(w).sum(axis=0) + _float32_bound(x, qw, dtype)
    err = np.abs(out.astype(np.float64) - w4a16)
    assert (err <= bound).all()
    assert err.max() > 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_w4a8_quantize_rows_is_quantize_activations_in_mma_order(host_builder: HostKernelBuilder,
                                                                 host_rng: np.random.Generator, dtype: str) -> None:
    """hal_w4a8_quantize_rows: hal's per-token codes and scales bit for bit, each column where w4a8_column says;
    hal_w8a8_quantize_rows keeps column order."""
    m, k = 6, 160
    x = (host_rng.standard_normal((m, k)) * np.exp(host_rng.uniform(-3, 3, (m, 1)))).astype(NUMPY_DTYPES[dtype])
    x[4] = 0  # an all-zero row: scale 1
    xq_ref, sx_ref = quantize_activations(x)
    xq, sx = _quantize(host_builder, host_rng, dtype, x, "hal_w4a8_quantize_rows")
    columns = np.array([w4a8_column(c) for c in range(k)])
    assert sorted(columns) == list(range(k))  # a permutation within each 32-column block
    np.testing.assert_array_equal(sx.view(np.uint32), sx_ref.view(np.uint32))
    np.testing.assert_array_equal(xq[:, columns], xq_ref)
    xq8, sx8 = _quantize(host_builder, host_rng, dtype, x, "hal_w8a8_quantize_rows")
    np.testing.assert_array_equal(xq8, xq_ref)
    np.testing.assert_array_equal(sx8.view(np.uint32), sx_ref.view(np.uint32))


def test_w4a8_column_order_matches_the_int4_records() -> None:
    """The A order puts at MMA position 4t+i (and 16+4t+i) the k that lane t's int4 record holds in byte i of
    b[0] (b[1]): even nibbles p = 0, 2, 4, 6 then odd ones, nibble p + 4e at k = 16 (p/2) + 8 (p%2) + 2t + e."""
    for t in range(4):
        for reg in range(2):  # b[0]: even nibbles (w & 0x0f0f0f0f), b[1]: odd ones ((w >> 4) & ...)
            for i in range(4):
                nibble = 2 * i + reg
                p, e = nibble % 4, nibble // 4
                k = 16 * (p // 2) + 8 * (p % 2) + 2 * t + e
                assert w4a8_column(k) == 16 * reg + 4 * t + i


def test_w4a8_tc_is_bit_reproducible(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """Same inputs, another CTA order and thread interleaving: the same bits (K-split partials summed in order)."""
    qw = quantize(host_rng.standard_normal((1024, 256)) / 32, bits=4, group_size=64, symmetric=False)
    x = host_rng.standard_normal((3, 1024)).astype(np.float16)
    first, ksplit = _run(host_builder, host_rng, "fp16", qw, x, MANY_CUS, shuffle_ctas=True)
    assert ksplit >= 3  # two partials would add up the same in either order
    again, _ = _run(host_builder, host_rng, "fp16", qw, x, MANY_CUS, shuffle_ctas=True)
    np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_w4a8_tc_non_finite_row_gives_nan_row(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                              bad: float) -> None:
    """A NaN or infinity in an activation row makes that whole output row NaN; the other rows are unaffected."""
    qw = quantize(host_rng.standard_normal((256, 132)) / 16, bits=4, group_size=32, symmetric=False)
    x = host_rng.standard_normal((5, 256))
    x[2, 77] = bad
    x = x.astype(np.float16)
    out, _ = _run(host_builder, host_rng, "fp16", qw, x, MANY_CUS)
    out64 = out.astype(np.float64)
    assert np.isnan(out64[2]).all()
    keep = [0, 1, 3, 4]
    err = np.abs(out64[keep] - _reference(x[keep], qw))
    assert (err <= _float32_bound(x[keep], qw, "fp16")).all()
