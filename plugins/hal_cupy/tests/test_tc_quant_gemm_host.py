"""The tensor-core quantised GEMM (``quant_gemm_tc.cu``), host-compiled, against the float64 references.

The kernel source runs on the CPU through the host prelude, whose ``mma.sync`` / ``ldmatrix`` / ``cp.async``
emulation follows the PTX fragment layouts (tested in ``test_tc_emulation.py``).  Weights are repacked by
``hal_cupy._tc_pack`` (numpy here, CuPy on a device); launches come from the plugin's host rules.  Inputs are
fresh each run (seed printed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hal_cupy._tc_pack import PackedWeightCache, pack_weight, padded_columns
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize, unpack_int4
from hal_core.testing.tolerances import tolerance

NUMPY_DTYPES: dict[str, Any] = {"fp16": np.float16, "bf16": BFLOAT16}
DTYPE_CODES = {"fp16": 1, "bf16": 2}
MANY_CUS, ONE_CU = 132, 1


def _random_weight(host_rng: np.random.Generator, k: int, n: int, bits: int, g: int,
                   symmetric: bool) -> QuantizedWeight:
    return quantize(host_rng.standard_normal((k, n)) / np.sqrt(k), bits=bits, group_size=g, symmetric=symmetric)


def _module(host_builder: HostKernelBuilder, spec: Any, host_rng: np.random.Generator) -> HostModule:
    module = host_builder.build(spec.source, dict(spec.defines))
    module.seed(int(host_rng.integers(1, 2**63)))
    return module


def _run(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str, qw: QuantizedWeight, x: np.ndarray,
         compute_units: int, shuffle_ctas: bool = False) -> tuple[np.ndarray, int, int]:
    """out = quantized_gemm(x, qw) through the tensor-core kernels; (out, ksplit, kb_per_split).

    ``shuffle_ctas``: run the GEMM's CTAs in a random order drawn from the module's fresh seed.
    """
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    frags = qg_rules.quant_gemm_tc_m_frags(m)
    gemm = _module(host_builder, qg_rules.quant_gemm_tc_spec(DTYPE_CODES[dtype], qw.bits, frags), host_rng)
    assert gemm.static_shared_bytes() == qg_rules.quant_gemm_tc_shared_bytes(qw.bits, frags)
    packed = pack_weight(qw)
    launch, ksplit, per_split = qg_rules.quant_gemm_tc_launch(qw.bits, m, n, k, g, compute_units)
    assert launch.grid[0] * qg_rules.QGEMM_TC_COLS == packed.npad
    out = np.full((m, n), np.nan, NUMPY_DTYPES[dtype])
    ws = np.full((ksplit, m, n), np.nan, np.float32) if ksplit > 1 else None  # every partial must be written
    tail = (m, n, k, g, per_split)
    gemm.shuffle_ctas(shuffle_ctas)
    if qw.bits == 4:
        gemm.launch(launch, out, ws, x, packed.qtc, packed.scales, packed.zeros, *tail)
    else:
        util = _module(host_builder, qg_rules.quant_util_spec(DTYPE_CODES[dtype]), host_rng)
        xq = np.zeros((m, k), np.int8)
        sx = np.full(m, np.nan, np.float32)
        util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, compute_units), xq, sx, x, k)
        gemm.launch(launch, out, ws, xq, sx, packed.qtc, packed.scales, packed.zeros, *tail)
    gemm.shuffle_ctas(False)
    if ws is not None:
        assert np.isnan(out.astype(np.float32)).all(), "with a K split the GEMM leaves out to the reduction"
        gemm.launch(qg_rules.quant_gemm_tc_reduce_launch(m, n, compute_units), out, ws, m * n, ksplit)
    return out, ksplit, per_split


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
        kind = "W4A16" if self.bits == 4 else "W8A8"
        return (f"{kind}-{self.dtype}-M{self.m}-N{self.n}-K{self.k}-G{self.group_size}-"
                f"{'sym' if self.symmetric else 'zeros'}-{'split' if self.split else 'noSplit'}")


CASES = [
    Case(4, "fp16", 1, 256, 1024, 128, False, MANY_CUS, True),
    Case(4, "bf16", 5, 132, 512, 32, True, MANY_CUS, True),  # N tail inside a 128-column tile
    Case(4, "fp16", 16, 200, 256, 64, True, ONE_CU, False),
    Case(4, "bf16", 64, 128, 256, 128, False, ONE_CU, False),  # 4 fragments
    Case(4, "fp16", 128, 136, 256, 32, False, MANY_CUS, False),  # two 64-row chunks
    Case(4, "bf16", 37, 256, 512, 64, True, MANY_CUS, True),  # rows past M zero-filled
    Case(4, "fp16", 3, 128, 1152, 128, False, MANY_CUS, True),  # stripes of 9 k-blocks split 4-block groups
    Case(8, "fp16", 1, 256, 512, 64, True, MANY_CUS, True),
    Case(8, "bf16", 5, 132, 256, 32, False, ONE_CU, False),
    Case(8, "fp16", 64, 200, 256, 128, False, MANY_CUS, False),
    Case(8, "bf16", 128, 128, 512, 64, True, ONE_CU, False),
    Case(8, "fp16", 16, 128, 1152, 128, False, MANY_CUS, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tc_gemm_matches_reference(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: Case) -> None:
    qw = _random_weight(host_rng, case.k, case.n, case.bits, case.group_size, case.symmetric)
    x = host_rng.standard_normal((case.m, case.k)).astype(NUMPY_DTYPES[case.dtype])
    out, ksplit, _ = _run(host_builder, host_rng, case.dtype, qw, x, case.compute_units)
    assert (ksplit > 1) == case.split
    expected = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    atol, rtol = tolerance("gemm", case.dtype)
    np.testing.assert_allclose(out.astype(np.float64), expected, atol=atol, rtol=rtol, err_msg=case.id)


@pytest.mark.parametrize("bits", [4, 8])
def test_tc_gemm_is_bit_reproducible(host_builder: HostKernelBuilder, host_rng: np.random.Generator, bits: int) -> None:
    """Same inputs, another CTA order and thread interleaving: the same bits (K-split partials are summed in split
    order)."""
    qw = _random_weight(host_rng, 1024, 256, bits, 64, False)
    x = host_rng.standard_normal((3, 1024)).astype(np.float16)
    first, ksplit, _ = _run(host_builder, host_rng, "fp16", qw, x, MANY_CUS, shuffle_ctas=True)
    assert ksplit >= 3  # two partials would add up the same in either order
    for _ in range(2):  # _run reseeds the CTA order and the interleaving
        again, _, _ = _run(host_builder, host_rng, "fp16", qw, x, MANY_CUS, shuffle_ctas=True)
        np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_w4a16_tc_nan_row_gives_nan_row(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                        dtype: str) -> None:
    """A NaN anywhere in an activation row makes that output row NaN; the other rows are unaffected."""
    qw = _random_weight(host_rng, 256, 132, 4, 32, False)
    x = host_rng.standard_normal((5, 256))
    x[2, 77] = np.nan
    x = x.astype(NUMPY_DTYPES[dtype])
    out, _, _ = _run(host_builder, host_rng, dtype, qw, x, MANY_CUS)
    out64 = out.astype(np.float64)
    assert np.isnan(out64[2]).all()
    keep = [0, 1, 3, 4]
    expected = OPS["quantized_gemm"].reference({"x": x[keep], "qweight": qw})
    atol, rtol = tolerance("gemm", dtype)
    np.testing.assert_allclose(out64[keep], expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------
# The packed layout itself, element by element
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_layout_holds_each_lanes_fragments(host_rng: np.random.Generator, bits: int) -> None:
    """Every packed element sits where the lane's MMA B fragment expects it (module docs of _tc_pack)."""
    k, n = 64, 40  # two k-blocks; N padded to 128
    qw = _random_weight(host_rng, k, n, bits, 32, False)
    codes = unpack_int4(qw.qweight) if bits == 4 else qw.qweight
    packed = pack_weight(qw)
    npad = padded_columns(n)
    assert packed.npad == npad == 128
    words = packed.qtc.reshape(k // 32, npad // 32, 32, -1)  # kb, cg, lane, word
    for _ in range(400):
        kb, cg = int(host_rng.integers(2)), int(host_rng.integers(4))
        lane, j = int(host_rng.integers(32)), int(host_rng.integers(4))
        g, t = lane >> 2, lane % 4
        col = 32 * cg + 8 * j + g
        if bits == 4:
            p = int(host_rng.integers(4))
            for e in range(2):
                row = 32 * kb + 16 * (p // 2) + 8 * (p % 2) + 2 * t + e
                want = int(codes[row, col]) if col < n else 0
                assert (int(words[kb, cg, lane, j]) >> (4 * (p + 4 * e))) & 0xF == want
        else:
            i, b = int(host_rng.integers(2)), int(host_rng.integers(4))
            row = 32 * kb + 16 * i + 4 * t + b
            want = (int(codes[row, col]) - 128) & 0xFF if col < n else 0x80
            assert (int(words[kb, cg, lane, 2 * j + i]) >> (8 * b)) & 0xFF == want
    np.testing.assert_array_equal(packed.scales[:, n:], 0)
    np.testing.assert_array_equal(packed.scales[:, :n], qw.scales)


def test_pack_rejects_what_the_kernels_cannot_read() -> None:
    qw = quantize(np.ones((64, 8)), bits=4, group_size=32, scale_dtype=np.float32)
    with pytest.raises(ValueError, match="float16 scales"):
        pack_weight(qw)
    qw16 = quantize(np.ones((48, 8)), bits=4, group_size=16)
    with pytest.raises(ValueError, match="multiples of 32"):
        pack_weight(qw16)


def test_packed_cache_is_bounded_and_keyed_by_identity(host_rng: np.random.Generator) -> None:
    weights = [_random_weight(host_rng, 64, 128, 4, 32, True) for _ in range(3)]
    one = pack_weight(weights[0]).nbytes
    cache = PackedWeightCache(max_bytes=2 * one)
    builds: list[int] = []

    def get(i: int) -> Any:
        return cache.get(weights[i], "dev0", lambda: builds.append(i) or pack_weight(weights[i]))

    first = get(0)
    assert get(0) is first and builds == [0]  # a hit: no second repack
    get(1)
    get(2)  # over the bound: weight 0 (least recently used) goes
    assert len(cache) == 2 and cache.nbytes <= 2 * one
    get(0)
    assert builds == [0, 1, 2, 0]
    del weights[2]  # weight 2 is garbage: its entry goes with it
    import gc

    gc.collect()
    assert len(cache) == 1
