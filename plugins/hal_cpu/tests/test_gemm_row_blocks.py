"""``quantized_gemm`` calls of many rows run as row blocks (hal_cpu.ops._rules.GEMM_ROW_BLOCK): the spans cover
every row once, the result is the unblocked call's (the same bits where the kernel is the same: int8 activations,
W4A16's blocked kernel) and within the float64 reference's tolerance, through the front door, a bound op's first
call and its planned runner; non-finite rows keep their pattern in any block; a kernel forced while tuning runs
every block; the float32 result held during the call is one block's, not the whole call's."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import _rules
from hal_cpu.ops import quantized_gemm as qg

import hal_core
from hal_core import tuning
from hal_core.arrays import numpy_dtype
from hal_core.quant import QuantizedWeight, quantize

BLOCK = 16  # rows per block in these tests (the rules' 256 / 64 would need large inputs)
needs_native = pytest.mark.skipif(_native.try_load() is None, reason="the compiled kernels are not built here")


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rules, "GEMM_ROW_BLOCK", BLOCK)
    monkeypatch.setattr(_rules, "GEMM_ROW_BLOCK_HALF_DOT", BLOCK // 2)


def _unblocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rules, "GEMM_ROW_BLOCK", 1 << 30)
    monkeypatch.setattr(_rules, "GEMM_ROW_BLOCK_HALF_DOT", 1 << 30)


def _weight(rng: np.random.Generator, k: int, n: int, bits: int) -> QuantizedWeight:
    return quantize((rng.standard_normal((k, n)) * 0.05).astype(np.float32), bits=bits, group_size=32,
                    symmetric=bits == 8, scale_dtype=np.float16)


def _reference(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    return x.astype(np.float64) @ w.dequantize(np.float64)


@pytest.mark.parametrize("m", [1, 15, 31, 32, 33, 47, 48, 100])
@pytest.mark.parametrize("block", [0, 1, 8, 16, 256])
def test_row_spans_cover_every_row_once(m: int, block: int) -> None:
    spans = _rules.row_spans(m, block)
    assert spans[0][0] == 0 and spans[-1][1] == m
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    if block == 0 or m < 2 * block:
        assert spans == [(0, m)]
    else:
        assert all(stop - start == block for start, stop in spans[:-1])
        assert block <= spans[-1][1] - spans[-1][0] < 2 * block


def test_row_block_rules() -> None:
    assert _rules.gemm_row_block(True, False, False) == _rules.gemm_row_block(True, False, True) == 256
    assert _rules.gemm_row_block(False, True, False) == 64
    assert _rules.gemm_row_block(False, False, False) == 256
    assert _rules.gemm_row_block(False, False, True) == 0  # the blocked kernel's float32 result is the output


CASES = [(4, "int8", "bf16"), (4, "int8", "fp32"), (8, None, "fp16"), (4, "float", "fp32"), (4, "float", "bf16"),
         (4, "float", "fp16"), (4, "auto", "bf16")]


@needs_native
@pytest.mark.parametrize(("bits", "activations", "dtype"), CASES)
@pytest.mark.parametrize("m", [40, 57])
def test_blocked_call_matches_reference_and_unblocked_call(small_blocks: None, monkeypatch: pytest.MonkeyPatch,
                                                           bits: int, activations: str | None, dtype: str,
                                                           m: int) -> None:
    seed = int(np.random.default_rng().integers(2**31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    k, n = 96, 80
    w = _weight(rng, k, n, bits)
    x = rng.uniform(-1, 1, (m, k)).astype(numpy_dtype(dtype))
    kwargs = {} if activations is None else {"activations": activations}
    be = hal_core.get_backend("cpu")
    front = be.ops.quantized_gemm(x=x, qweight=w, **kwargs)
    bound = be.ops.bind("quantized_gemm", qweight=w, **kwargs)
    first, kept = bound(x=x), bound(x=x.copy())
    assert front.dtype == x.dtype and front.shape == (m, n)
    np.testing.assert_array_equal(first, front)
    np.testing.assert_array_equal(kept, front)
    ref = _reference(x, w)
    tol = 3e-2 if activations in ("int8", "auto") or bits == 8 or dtype != "fp32" else 1e-5
    np.testing.assert_allclose(front.astype(np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())
    int8 = bits == 8 or activations in ("int8", "auto")
    if int8 or dtype == "fp32":  # the same kernel with or without blocks: the same bits
        _unblocked(monkeypatch)
        whole = be.ops.bind("quantized_gemm", qweight=w, **kwargs)(x=x)
        np.testing.assert_array_equal(front.view(np.uint8), whole.view(np.uint8))


@needs_native
@pytest.mark.parametrize(("bits", "activations", "dtype"), [(4, "int8", "bf16"), (4, "float", "bf16"),
                                                            (4, "float", "fp32"), (8, None, "fp16")])
def test_non_finite_rows_in_a_later_block(small_blocks: None, bits: int, activations: str | None, dtype: str) -> None:
    rng = np.random.default_rng(7)
    k, n, m = 64, 48, 50
    w = _weight(rng, k, n, bits)
    x = rng.uniform(-1, 1, (m, k)).astype(numpy_dtype(dtype))
    x[3, 5], x[20, 0], x[45, 63] = np.nan, np.inf, -np.inf
    kwargs = {} if activations is None else {"activations": activations}
    be = hal_core.get_backend("cpu")
    bound = be.ops.bind("quantized_gemm", qweight=w, **kwargs)
    for y in (be.ops.quantized_gemm(x=x, qweight=w, **kwargs), bound(x=x), bound(x=x)):
        y64 = y.astype(np.float64)
        bad = [3, 20, 45]
        good = np.setdiff1d(np.arange(m), bad)
        assert np.isfinite(y64[good]).all()
        if bits == 8 or activations == "int8":
            assert np.isnan(y64[bad]).all()  # int8 activations: a row holding NaN or inf is a NaN row
        else:
            ref = _reference(x, w)
            np.testing.assert_array_equal(np.isnan(y64[bad]), np.isnan(ref[bad]))
            np.testing.assert_array_equal(np.isposinf(y64[bad]), np.isposinf(ref[bad]))


@needs_native
def test_a_forced_kernel_runs_every_block(small_blocks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    w = _weight(rng, 64, 48, 4)
    x = rng.uniform(-1, 1, (40, 64)).astype(numpy_dtype("bf16"))
    be = hal_core.get_backend("cpu")
    calls: list[str | None] = []
    gemm = qg.gemm

    def counted(x: np.ndarray, qweight: QuantizedWeight, **kwargs: object) -> np.ndarray:
        calls.append(kwargs.get("kernel"))  # type: ignore[arg-type]
        return gemm(x, qweight, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(qg, "gemm", counted)
    with tuning.override({"kernel": "blocked"}):
        forced = be.ops.quantized_gemm(x=x, qweight=w, activations="float")
    assert calls == ["blocked"] * len(_rules.row_spans(40, BLOCK))  # blocked-kernel blocks: GEMM_ROW_BLOCK
    _unblocked(monkeypatch)
    whole = qg.gemm_in_blocks(x, w, x.dtype, kernel="blocked")
    np.testing.assert_array_equal(forced.view(np.uint16), whole.view(np.uint16))


@needs_native
@pytest.mark.parametrize("planned", [False, True])
def test_float32_result_held_is_one_block(planned: bool) -> None:
    """With the rules' blocks (256 rows): numpy's allocations during a 2048-row bf16 W4A8 call stay within the
    output and two blocks' float32 results, where the whole call's float32 result alone is twice the output."""
    rng = np.random.default_rng(5)
    m, k, n = 2048, 128, 512
    w = _weight(rng, k, n, 4)
    x = rng.uniform(-1, 1, (m, k)).astype(numpy_dtype("bf16"))
    be = hal_core.get_backend("cpu")
    call = be.ops.bind("quantized_gemm", qweight=w, activations="int8") if planned else None
    if call is not None:
        call(x=x)  # the first call plans
    tracemalloc.start()
    try:
        y = call(x=x) if call is not None else be.ops.quantized_gemm(x=x, qweight=w, activations="int8")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    block_f32 = 2 * _rules.GEMM_ROW_BLOCK * n * 4
    assert peak <= y.nbytes + block_f32 + (1 << 16), (peak, y.nbytes, block_f32)
    assert m * n * 4 > y.nbytes + block_f32  # the whole float32 result would not fit this bound


@needs_native
def test_the_kernel_knob_reports_the_kernel_its_blocks_run() -> None:
    """``hal info --explain`` reads the knob's rule: for a call in blocks, the kernel of a block's rows."""
    from hal_cpu.ops import _knobs

    native = _native.try_load()
    assert native is not None
    rng = np.random.default_rng(11)
    w = _weight(rng, 64, 48, 4)
    be = hal_core.get_backend("cpu")
    for m, dtype in [(1, "bf16"), (4096, "bf16"), (4096, "fp32")]:
        x = np.zeros((m, 64), numpy_dtype(dtype))
        call = be.ops.prepare("quantized_gemm", x=x, qweight=w, activations="float")
        spans = _rules.row_spans(m, qg.row_block(native, x, w))
        expected = _rules.gemm_kernel(spans[0][1] - spans[0][0], 4, w.group_size, False, native.isa,
                                      qg.half_dot(native, x.dtype))
        assert _knobs.GEMM_KERNEL.rule(call) == expected
    if qg.half_dot(native, np.dtype(numpy_dtype("bf16"))):
        x = np.zeros((4096, 64), numpy_dtype("bf16"))
        call = be.ops.prepare("quantized_gemm", x=x, qweight=w, activations="float")
        assert _knobs.GEMM_KERNEL.rule(call) == "registers"  # 64-row blocks on bf16 dot products
