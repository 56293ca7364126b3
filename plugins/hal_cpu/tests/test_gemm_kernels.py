"""The compiled quantized_gemm kernels against the float64 reference: W4A16 (every kernel) and W8A8 (more W8A8 cases:
test_w8a8_kernels.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hal_cpu.ops import _rules, quantized_gemm

from hal_core.ops import OPS
from hal_core.quant import quantize_activations
from hal_core.testing.inputs import assert_close, quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference
M_VALUES = [1, 3, 16, 64, 257]


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("kernel", ["registers", "blocked", "tiles"])
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, True), (64, False), (128, True), (128, False)])
def test_w4a16_matches_reference(variant: str, rng: np.random.Generator, m: int, kernel: str, group_size: int,
                                 symmetric: bool) -> None:
    """Every W4A16 kernel, every M class, symmetric or with zero points; N leaves a ragged column tail."""
    args = quantized_gemm_inputs(rng, m=m, k=2 * group_size, n=83, bits=4, group_size=group_size,
                                 symmetric=symmetric, dtype="fp32")
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel=kernel, tile_bytes=4096)
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W4A16 {kernel}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32, "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_activation_and_scale_dtypes(variant: str, rng: np.random.Generator, dtype: str, scale_dtype: object,
                                     bits: int) -> None:
    """fp16/bf16/fp32 activations and scales are read in their storage dtype."""
    from hal_core.arrays import BFLOAT16

    args = quantized_gemm_inputs(rng, m=5, k=256, n=70, bits=bits, group_size=64, symmetric=False, dtype=dtype)
    qw = args["qweight"]
    args["qweight"] = replace(qw, scales=np.asarray(qw.scales).astype(BFLOAT16 if scale_dtype == "bf16"
                                                                       else scale_dtype))
    got = quantized_gemm.gemm(args["x"], args["qweight"]).astype(args["x"].dtype)
    assert_close(got, REFERENCE(args), kind="gemm", dtype=dtype, what=f"{variant} int{bits} scales {scale_dtype}")


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order(variant: str, rng: np.random.Generator, m: int, bits: int) -> None:
    """Act-order weights (g_idx): int4 through the blocked kernel (each row of K its own group's scales), int8
    with its rows grouped by a permutation."""
    args = quantized_gemm_inputs(rng, m=m, k=256, n=40, bits=bits, group_size=32, symmetric=False, dtype="fp32",
                                 act_order=True)
    assert_close(quantized_gemm.gemm(args["x"], args["qweight"]), REFERENCE(args), kind="gemm", dtype="fp32",
                 what=f"{variant} int{bits} act-order")


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, False), (128, True), (1024, False)])
def test_w8a8_matches_reference(variant: str, rng: np.random.Generator, m: int, group_size: int,
                                symmetric: bool) -> None:
    """W8A8: exact integer group sums (groups past 512 rows included), scaled once per group and token."""
    k = max(256, group_size)
    args = quantized_gemm_inputs(rng, m=m, k=k, n=77, bits=8, group_size=group_size, symmetric=symmetric,
                                 dtype="fp32")
    got = quantized_gemm.gemm(args["x"], args["qweight"])
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W8A8")


def test_w8a8_quantises_activations_like_the_reference(rng: np.random.Generator) -> None:
    """With a one-hot weight the kernel's output exposes its quantised activations: they equal the reference's."""
    from hal_core.quant import QuantizedWeight

    k = 64
    x = (rng.standard_normal((9, k)) * 10.0 ** rng.integers(-3, 3, (9, 1))).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scale 1
    x[4, :] = np.float32(1e-44)  # subnormals: the scale never underflows
    codes = np.full((k, k), 128, dtype=np.uint8) + np.eye(k, dtype=np.uint8)  # (q - z) = identity
    qw = QuantizedWeight(codes, np.ones((1, k), np.float32), None, 8, k, (k, k))
    xq, sx = quantize_activations(x)
    np.testing.assert_array_equal(quantized_gemm.gemm(x, qw), xq.astype(np.float32) * sx[:, None])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_w8a8_non_finite_row_gives_nan_row(rng: np.random.Generator, bad: float) -> None:
    """A row of x holding NaN or Inf gives a NaN output row; the other rows are unaffected."""
    args = quantized_gemm_inputs(rng, m=4, k=128, n=40, bits=8, group_size=64, symmetric=True, dtype="fp32")
    clean = REFERENCE(args)
    args["x"][2, 17] = bad
    got = quantized_gemm.gemm(args["x"], args["qweight"])
    assert np.isnan(got[2]).all()
    rows = [0, 1, 3]
    assert_close(got[rows], clean[rows], kind="gemm", dtype="fp32", what="W8A8 clean rows")


@pytest.mark.parametrize("m", [1, 2, 3, 6, 16, 32, 67])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, False), (128, True), (128, False)])
def test_w4a16_half_activations_keep_float32_accuracy(variant: str, rng: np.random.Generator, m: int, dtype: str,
                                                      group_size: int, symmetric: bool) -> None:
    """fp16/bf16 activations through the in-register kernel (AVX512_BF16 dot products where the CPU has them):
    the float32 result meets the float32 tolerance against the float64 reference on the same rounded inputs,
    so no activation is rounded to a narrower type on the way (an fp16 value is split exactly into bf16 parts)."""
    args = quantized_gemm_inputs(rng, m=m, k=4 * group_size, n=300, bits=4, group_size=group_size,
                                 symmetric=symmetric, dtype=dtype)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers")
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} W4A16 registers {dtype} x")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_w4a16_half_activation_non_finite(rng: np.random.Generator, dtype: str, bad: float) -> None:
    """A non-finite fp16/bf16 activation gives the reference's non-finite pattern in its row, the rest unchanged."""
    args = quantized_gemm_inputs(rng, m=3, k=256, n=80, bits=4, group_size=64, symmetric=False, dtype=dtype)
    args["x"][1, 5] = bad
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers")
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what=f"registers {dtype} x with {bad}")


@pytest.mark.parametrize(("m", "k", "n", "group_size"), [(1, 640, 300, 128), (19, 520, 290, 8), (70, 1032, 97, 129)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_w4a16_blocked_panel_edges(variant: str, rng: np.random.Generator, m: int, k: int, n: int, group_size: int,
                                   dtype: str) -> None:
    """The blocked kernel across its blocks: K past one panel and not a multiple of it, M past the register
    tile with a remainder, N past a task's columns with a ragged strip, groups that split packed words."""
    args = quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=4, group_size=group_size, symmetric=False, dtype=dtype)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="blocked").astype(args["x"].dtype)
    assert_close(got, REFERENCE(args), kind="gemm", dtype=dtype, what=f"{variant} W4A16 blocked {m}x{k}x{n}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w4a16_blocked_threads_agree(rng: np.random.Generator, threads: int) -> None:
    """Which task computes a column block never changes its value."""
    args = quantized_gemm_inputs(rng, m=20, k=768, n=600, bits=4, group_size=64, symmetric=False, dtype="fp32")
    serial = quantized_gemm.gemm(args["x"], args["qweight"], kernel="blocked", threads=1)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="blocked", threads=threads)
    np.testing.assert_array_equal(got, serial)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_w4a16_blocked_non_finite_rows_follow_ieee(variant: str, rng: np.random.Generator, bad: float) -> None:
    """Non-finite activations give what the float64 reference gives (inf times a zero weight is NaN there too);
    the other rows, in the same register tile, are unaffected."""
    args = quantized_gemm_inputs(rng, m=10, k=384, n=70, bits=4, group_size=64, symmetric=False, dtype="fp32")
    args["x"][3, 100] = bad
    assert_close(quantized_gemm.gemm(args["x"], args["qweight"], kernel="blocked"), REFERENCE(args), kind="gemm",
                 dtype="fp32", what=f"{variant} W4A16 blocked with {bad}")


def test_w4a16_nan_activation_propagates(rng: np.random.Generator) -> None:
    """A NaN activation reaches every output of its row in every W4A16 kernel (no masking by zero codes)."""
    args = quantized_gemm_inputs(rng, m=3, k=128, n=48, bits=4, group_size=32, symmetric=True, dtype="fp32")
    args["x"][1, 9] = np.nan
    for kernel in ("registers", "blocked", "tiles"):
        got = quantized_gemm.gemm(args["x"], args["qweight"], kernel=kernel)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(REFERENCE(args)))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n_tile", [64, 128, 4096])
def test_tiling_and_threads_agree(rng: np.random.Generator, threads: int, n_tile: int) -> None:
    """Column tiles and thread counts only change which task computes a column, never its value."""
    args = quantized_gemm_inputs(rng, m=3, k=256, n=300, bits=4, group_size=64, symmetric=False, dtype="fp32")
    serial = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=1, n_tile=64)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=threads, n_tile=n_tile)
    np.testing.assert_array_equal(got, serial)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 21])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("k", "group_size"), [(256, 32), (384, 96), (512, 128), (1024, 1024)])
def test_w4a16_sweep_matches_reference(variant: str, rng: np.random.Generator, m: int, dtype: str, k: int,
                                       group_size: int) -> None:
    """The sweep (one column range per task, packed rows in passes of 8): groups of fewer rows than a
    pass, of a pass and a remainder, of two passes and of the whole K (many passes, partial sums kept between
    them), over two ranges of uneven width and a ragged column tail; above M = 2 (the float32 loop's sweep) row
    tiles of 4 with a remainder, and more than one block of 16 rows."""
    args = quantized_gemm_inputs(rng, m=m, k=k, n=300, bits=4, group_size=group_size, symmetric=False,
                                 dtype=dtype)
    got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=2, n_tile=192)
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32",
                 what=f"{variant} W4A16 sweep M={m} G={group_size} {dtype} x")


@pytest.mark.parametrize("m", [1, 2, 7, 18])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_w4a16_sweep_tiling_and_threads_agree(rng: np.random.Generator, m: int, dtype: str) -> None:
    """Where the sweep's ranges start and which thread runs them never changes a column's value."""
    args = quantized_gemm_inputs(rng, m=m, k=512, n=700, bits=4, group_size=128, symmetric=False, dtype=dtype)
    serial = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=1, n_tile=64)
    for threads, n_tile in [(1, 4096), (2, 128), (3, 64), (2, None)]:
        got = quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers", threads=threads, n_tile=n_tile)
        np.testing.assert_array_equal(got, serial, err_msg=f"threads={threads} n_tile={n_tile}")


def test_sweep_column_tile_rule() -> None:
    """Up to SWEEP_M_MAX rows one range per thread (long runs), above it about 8 tasks per thread."""
    for n, threads in [(11008, 2), (4096, 2), (300, 3), (64, 8), (28672, 16)]:
        sweep = _rules.gemv_column_tile(n, threads, 1)
        assert sweep % 64 == 0 and -(-n // sweep) <= threads and sweep * threads >= n
        tiles = _rules.gemv_column_tile(n, threads, _rules.SWEEP_M_MAX + 1)
        assert tiles % 64 == 0 and tiles <= sweep


def test_float_sweep_column_tile_rule() -> None:
    """The float32 sweep at any M: one range per thread while the M rows of partial sums fit SWEEP_PARTIAL_BYTES,
    else narrower ranges within it, in a multiple of the thread count."""
    for n, threads in [(11008, 2), (4096, 2), (300, 3), (28672, 16)]:
        for m in (1, 2, 3, 16, 64, 257):
            tile = _rules.sweep_column_tile(n, threads, m)
            assert tile % 64 == 0 and (m * tile * 4 <= _rules.SWEEP_PARTIAL_BYTES or tile == 64)
            assert -(-n // tile) >= min(threads, -(-n // 64))
            if m <= _rules.SWEEP_M_MAX:
                assert tile == _rules.gemv_column_tile(n, threads, m)
    assert _rules.sweep_column_tile(11008, 2, 16) == 2752  # 4 ranges of 4096 columns at most
    assert _rules.sweep_column_tile(11008, 2, 64) == 960


def test_registers_kernel_refuses_act_order(rng: np.random.Generator) -> None:
    """Asking the in-register int4 kernel for an act-order weight is an error, not a wrong answer."""
    args = quantized_gemm_inputs(rng, m=2, k=64, n=16, bits=4, group_size=32, symmetric=True, dtype="fp32",
                                 act_order=True)
    with pytest.raises(ValueError, match="registers"):
        quantized_gemm.gemm(args["x"], args["qweight"], kernel="registers")


@pytest.mark.parametrize("m", [1, 3, 16, 64, 257])
def test_w4a16_act_order_kernels_agree_with_reference(rng: np.random.Generator, m: int) -> None:
    """Act-order int4 through both kernels that serve it, K across several panels."""
    args = quantized_gemm_inputs(rng, m=m, k=640, n=72, bits=4, group_size=64, symmetric=False, dtype="fp16",
                                 act_order=True)
    for kernel in ("blocked", "tiles"):
        got = quantized_gemm.gemm(args["x"], args["qweight"], kernel=kernel).astype(np.float16)
        assert_close(got, REFERENCE(args), kind="gemm", dtype="fp16", what=f"act-order {kernel}")


def test_blocked_kernel_allocates_no_float_weight(rng: np.random.Generator) -> None:
    """The blocked kernel's workspaces (packed activations, one panel per task) are far below the float weight:
    the process's peak RSS grows by less than a quarter of the K x N float32 weight."""
    import resource

    args = quantized_gemm_inputs(rng, m=8, k=4096, n=4096, bits=4, group_size=128, symmetric=True, dtype="fp32")
    float_weight = 4096 * 4096 * 4
    quantized_gemm.gemm(args["x"][:1], args["qweight"], kernel="blocked")  # pool threads and first-touch pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    quantized_gemm.gemm(args["x"], args["qweight"], kernel="blocked")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert after - before < float_weight // 4


def test_no_float_weight_cache(rng: np.random.Generator) -> None:
    """No dequantised weight outlives a call: the module keeps no cache, and memory after a call is back to
    what it was, while a 'tiles' call allocates only its bounded tile (not the K x N float weight)."""
    import tracemalloc

    assert not [name for name in vars(quantized_gemm) if "cache" in name.lower() and not name.startswith("__")]
    args, other = (quantized_gemm_inputs(rng, m=40, k=1024, n=2048, bits=4, group_size=128, symmetric=True,
                                         dtype="fp32") for _ in range(2))
    float_weight = 1024 * 2048 * 4
    # the process's one-time allocations (first-call setup), on another weight: a cache per weight would still grow
    quantized_gemm.gemm(other["x"], other["qweight"], kernel="tiles", tile_bytes=256 * 1024)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        y = quantized_gemm.gemm(args["x"], args["qweight"], kernel="tiles", tile_bytes=256 * 1024)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert current - before <= y.nbytes + 4096
    assert peak - before < y.nbytes + 2 * 256 * 1024 + 64 * 1024 < float_weight // 4


def test_rules_pick_kernels() -> None:
    """The crossover rule: in-register int4 kernel for small M, the blocked kernel above or for act-order/odd
    groups, BLAS tiles instead where the blocked kernel has no hand-sized tile (the portable baseline)."""
    assert _rules.gemm_kernel(1, 4, 128, False) == "registers"
    assert _rules.gemm_kernel(_rules.SMALL_M_MAX, 4, 128, False) == "registers"
    assert _rules.gemm_kernel(_rules.SMALL_M_MAX + 1, 4, 128, False) == "blocked"
    assert _rules.gemm_kernel(_rules.SMALL_M_MAX + 1, 4, 128, False, "avx2") == "blocked"
    assert _rules.gemm_kernel(_rules.SMALL_M_MAX + 1, 4, 128, False, "baseline") == "tiles"
    assert _rules.gemm_kernel(1, 4, 128, True) == "blocked"
    assert _rules.gemm_kernel(1, 4, 4, False) == "blocked"
    assert _rules.gemm_kernel(1, 4, 4, False, "baseline") == "tiles"
    assert _rules.gemm_kernel(_rules.HALF_DOT_M_MAX, 4, 128, False, half_dot=True) == "registers"
    assert _rules.gemm_kernel(_rules.HALF_DOT_M_MAX + 1, 4, 128, False, half_dot=True) == "blocked"
    assert _rules.gemm_kernel(64, 4, 128, True, half_dot=True) == "blocked"
    assert _rules.gemm_kernel(1000, 8, 128, True) == "registers"


def test_half_dot_only_in_the_avx512_variant(variant: str, native: object) -> None:
    """The bf16 dot-product loop is reported only where it runs (the avx512 variant on a CPU with AVX512_BF16),
    and only for 2-byte activations."""
    import numpy as np

    got = quantized_gemm.half_dot(native, np.dtype(np.float16))
    if variant not in ("avx512", "avx512vnni"):
        assert not got
    assert not quantized_gemm.half_dot(native, np.dtype(np.float32))
