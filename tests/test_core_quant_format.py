"""The quantisation formats: int4 packing, (de)quantisation error bounds, W8A8 activations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, pack_int4, quantize, quantize_activations, unpack_int4

codes = st.integers(1, 8).flatmap(
    lambda rows: st.integers(1, 12).flatmap(
        lambda cols: hnp.arrays(np.uint8, (8 * rows, cols), elements=st.integers(0, 15))
    )
)


@given(codes)
def test_pack_unpack_round_trip(q: np.ndarray) -> None:
    """unpack_int4(pack_int4(q)) == q for every code matrix with K divisible by 8."""
    packed = pack_int4(q)
    assert packed.dtype == np.uint32 and packed.shape == (q.shape[0] // 8, q.shape[1])
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_pack_layout_is_little_nibble_first() -> None:
    """Bits 4j..4j+3 of word [r, n] hold code q[8r + j, n]."""
    q = np.arange(8, dtype=np.uint8).reshape(8, 1)
    assert int(pack_int4(q)[0, 0]) == 0x76543210


@pytest.mark.parametrize(
    ("codes", "match"),
    [(np.zeros((7, 2), np.uint8), "divisible by 8"), (np.full((8, 1), 16), "0..15"), (np.full((8, 1), -1), "0..15")],
    ids=["k-not-multiple-of-8", "code-too-large", "code-negative"],
)
def test_pack_rejects_bad_codes(codes: np.ndarray, match: str) -> None:
    """pack_int4 refuses shapes and values the format cannot hold."""
    with pytest.raises(ValueError, match=match):
        pack_int4(codes)


weights = st.tuples(st.sampled_from([32, 64, 128]), st.integers(1, 3), st.integers(1, 9), st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None)
@given(weights, st.sampled_from([4, 8]), st.booleans())
def test_quantize_dequantize_error_is_bounded(params, bits: int, symmetric: bool) -> None:
    """|w - dequantize(quantize(w))| <= half a step, per group and column (float32 scales)."""
    group, groups, n, seed = params
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((group * groups, n)) * rng.uniform(0.01, 10)
    qw = quantize(w, bits=bits, group_size=group, symmetric=symmetric, scale_dtype=np.float32)
    assert qw.shape == w.shape and qw.bits == bits and qw.symmetric is symmetric
    step = np.repeat(qw.scales.astype(np.float64), group, axis=0)
    err = np.abs(qw.dequantize() - w)
    bound = step * 0.5 * (1 + 1e-5) + 1e-12
    assert (err <= bound).all(), f"seed={seed} max excess {(err - bound).max()}"


def test_dequantize_is_exact_on_stored_values() -> None:
    """dequantize() is (q - z) * s of the stored codes, zeros and scales, computed in float64."""
    rng = np.random.default_rng(7)
    qw = quantize(rng.standard_normal((64, 5)), bits=4, group_size=32, symmetric=False)
    q = qw.codes().astype(np.float64)
    z = np.repeat(qw.zeros.astype(np.float64), 32, axis=0)
    s = np.repeat(qw.scales.astype(np.float64), 32, axis=0)
    np.testing.assert_array_equal(qw.dequantize(), (q - z) * s)


def test_symmetric_zero_point_is_implicit() -> None:
    """Symmetric weights store no zeros; the zero point is 8 for int4 and 128 for int8."""
    w = np.linspace(-1, 1, 64 * 2).reshape(64, 2)
    assert quantize(w, bits=4, group_size=64).zeros is None
    assert quantize(w, bits=4, group_size=64).default_zero == 8
    assert quantize(w, bits=8, group_size=64).default_zero == 128


def test_act_order_g_idx_selects_groups() -> None:
    """With g_idx, each row k uses group g_idx[k] for its scale and zero."""
    rng = np.random.default_rng(3)
    qw = quantize(rng.standard_normal((64, 4)), group_size=32)
    g_idx = np.r_[np.ones(32), np.zeros(32)].astype(np.int32)
    permuted = QuantizedWeight(qweight=qw.qweight, scales=qw.scales, zeros=None, bits=4, group_size=32,
                               shape=qw.shape, g_idx=g_idx)
    codes = qw.codes().astype(np.float64)
    expected = (codes - 8) * qw.scales.astype(np.float64)[g_idx]
    np.testing.assert_array_equal(permuted.dequantize(), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"bits": 3}, "bits"), ({"group_size": 48}, "group_size"), ({"group_size": 0}, "group_size")],
    ids=["bits-3", "group-not-divisor", "group-zero"],
)
def test_quantize_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """quantize() names the argument it refuses."""
    with pytest.raises(ValueError, match=match):
        quantize(np.ones((64, 4)), **kwargs)


def test_quantized_weight_validates_shapes() -> None:
    """QuantizedWeight refuses arrays whose shapes disagree with its logical shape."""
    qw = quantize(np.ones((64, 4)), group_size=32)
    with pytest.raises(ValueError, match="scales must have shape"):
        QuantizedWeight(qweight=qw.qweight, scales=qw.scales[:1], zeros=None, bits=4, group_size=32, shape=(64, 4))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
                  elements=st.floats(-1e4, 1e4, width=32)))
def test_activation_quantization_error_is_half_a_step(x: np.ndarray) -> None:
    """Per-token int8: |x - xq * sx| <= sx / 2 per row, with |xq| <= 127."""
    xq, sx = quantize_activations(x)
    assert xq.dtype == np.int8 and sx.dtype == np.float32 and sx.shape == (x.shape[0],)
    assert np.abs(xq.astype(np.int32)).max() <= 127
    err = np.abs(x.astype(np.float64) - xq.astype(np.float64) * sx[:, None])
    assert (err <= sx[:, None].astype(np.float64) * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["fp32", "fp16", "bf16"])
def test_activation_rows_with_nan_or_inf_get_a_nan_scale_and_zero_codes(dtype: Any) -> None:
    """A row holding NaN or +-inf: sx NaN and xq 0 (a NaN W8A8 row); the other rows are unaffected."""
    rng = np.random.default_rng(11)
    x = rng.uniform(-2, 2, (5, 40)).astype(dtype)
    clean_xq, clean_sx = quantize_activations(x)
    x[1, 3], x[2, 0], x[3, [5, 39]] = np.nan, np.inf, (-np.inf, np.nan)
    xq, sx = quantize_activations(x)
    assert np.isnan(sx[1:4]).all() and not xq[1:4].any()
    np.testing.assert_array_equal(sx[[0, 4]], clean_sx[[0, 4]])
    np.testing.assert_array_equal(xq[[0, 4]], clean_xq[[0, 4]])
    qw = quantize(rng.standard_normal((40, 3)), bits=8, group_size=8)
    y = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    assert np.isnan(y[1:4]).all() and np.isfinite(y[[0, 4]]).all()


def test_worked_example_of_the_docs() -> None:
    """The numbers quoted in docs/quantization.md's worked example are what the code produces."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "quantization.md").read_text()
    w = np.array([[0.7], [-0.35], [0.1], [0.0], [-0.7], [0.35], [0.2], [-0.1]])
    qw = quantize(w, bits=4, group_size=8)
    assert float(qw.scales[0, 0]) == 0.0999755859375 and "0.0999755859375" in doc
    assert qw.codes().ravel().tolist() == [15, 4, 9, 8, 1, 12, 10, 7]
    assert hex(int(qw.qweight[0, 0])) == "0x7ac1894f" and "0x7ac1894f" in doc
    x = np.array([[1, 0, 0, 0, 0, 0, 1, 0]], np.float16)
    assert round(float((x.astype(np.float64) @ qw.dequantize())[0, 0]), 5) == 0.89978
    asym = quantize(w, bits=4, group_size=8, symmetric=False)
    assert int(asym.zeros[0, 0]) == 8 and hex(int(asym.qweight[0, 0])) == "0x7ac0894f" and "0x7ac0894f" in doc
    q8 = quantize(w, bits=8, group_size=8)
    assert q8.codes().ravel().tolist() == [255, 65, 146, 128, 1, 191, 164, 110]
    x8 = np.array([[0.5, 0, 0, 0, 0, 0, -0.25, 0]], np.float16)
    y = OPS["quantized_gemm"].reference({"x": x8, "qweight": q8})
    assert round(float(y[0, 0]), 6) == 0.300026 and "0.300026" in doc


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_quantize_accepts_strided_weights(cpu: Any, bits: int, symmetric: bool) -> None:
    """quantize(w.T) (an nn.Linear weight [N, K] transposed) gives the same contiguous weight as a copy."""
    rng = np.random.default_rng(5)
    linear_weight = rng.standard_normal((48, 128)).astype(np.float32)  # [out_features, in_features]
    strided = {"transposed": linear_weight.T, "fortran": np.asfortranarray(linear_weight.T),
               "every-other-column": np.repeat(linear_weight.T, 2, axis=1)[:, ::2]}
    want = quantize(np.ascontiguousarray(linear_weight.T), bits=bits, group_size=32, symmetric=symmetric)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    for name, w in strided.items():
        qw = quantize(w, bits=bits, group_size=32, symmetric=symmetric)
        assert qw == want, name
        assert all(a.flags.c_contiguous for a in qw.arrays().values()), name
        got = cpu.ops.quantized_gemm(x, qw)  # refused as non-contiguous before
        np.testing.assert_allclose(got, OPS["quantized_gemm"].reference({"x": x, "qweight": want}),
                                   rtol=1e-4, atol=1e-4)


def test_quantize_accepts_a_torch_linear_weight() -> None:
    """A torch nn.Linear weight (requires_grad, bf16 too) quantises through .T without a manual copy."""
    torch = pytest.importorskip("torch")
    linear = torch.nn.Linear(64, 16, bias=False)
    want = quantize(linear.weight.detach().numpy().T.copy(), group_size=32)
    assert quantize(linear.weight.T, group_size=32) == want
    bf16 = linear.weight.detach().to(torch.bfloat16)
    expected = quantize(bf16.float().numpy().T.copy(), group_size=32)
    assert quantize(bf16.T, group_size=32) == expected


@pytest.mark.parametrize(("w", "kwargs", "error", "name"), [
    (np.ones((32, 4), np.complex64), {}, TypeError, "w"),
    (np.ones((32, 4), bool), {}, TypeError, "w"),
    (np.array([["a"] * 4] * 32), {}, TypeError, "w"),
    ([[1.0] * 4] * 32, {}, TypeError, "w"),
    (np.ones((32, 4)), {"bits": 4.0}, TypeError, "bits"),
    (np.ones((32, 4)), {"bits": True}, TypeError, "bits"),
    (np.ones((32, 4)), {"group_size": 32.0}, TypeError, "group_size"),
    (np.ones((32, 4)), {"group_size": "32"}, TypeError, "group_size"),
    (np.ones((32, 4)), {"symmetric": "no"}, TypeError, "symmetric"),
    (np.ones((32, 4)), {"symmetric": 0}, TypeError, "symmetric"),
    (np.ones((32, 4)), {"scale_dtype": np.float64}, TypeError, "scale_dtype"),
    (np.ones((32, 4)), {"scale_dtype": "fp13"}, TypeError, "scale_dtype"),
    (np.ones((32, 4)), {"bits": 3}, ValueError, "bits"),
    (np.ones((32, 4)), {"group_size": 0}, ValueError, "group_size"),
], ids=["complex", "bool", "strings", "list", "float-bits", "bool-bits", "float-group", "str-group",
        "str-symmetric", "int-symmetric", "fp64-scales", "unknown-scale-dtype", "bits-3", "group-0"])
def test_quantize_refuses_bad_arguments_naming_them(w: Any, kwargs: dict[str, Any], error: type[Exception],
                                                    name: str) -> None:
    """Complex, bool or non-array weights and wrongly typed options raise naming the argument."""
    with pytest.raises(error, match=f"argument {name!r}"):
        quantize(w, **{"group_size": 32, **kwargs})


def test_quantize_takes_numpy_integers_where_ints_go() -> None:
    """bits and group_size may be numpy integer scalars or 0-d arrays; the weight stores Python ints."""
    w = np.random.default_rng(6).standard_normal((64, 8))
    want = quantize(w, bits=8, group_size=32)
    got = quantize(w, bits=np.int8(8), group_size=np.array(32), symmetric=np.bool_(True))
    assert got == want and type(got.bits) is int and type(got.group_size) is int
    assert quantize(w, scale_dtype=BFLOAT16, group_size=np.uint16(32)).scales.dtype == BFLOAT16
