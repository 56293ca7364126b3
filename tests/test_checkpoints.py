"""Importing GPTQ and AWQ checkpoint tensors: exact dequantisation and quantized_gemm against float64."""

from __future__ import annotations

import numpy as np
import pytest

from hal_core.quant import QuantizedWeight, from_awq, from_gptq

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# -- an independent packer: plain Python integers, one value at a time -------------------------


def pack_along_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: int32 [K*bits/32, N]; row p*r + j sits at bits b*j of word [r, n]."""
    per = 32 // bits
    k, n = codes.shape
    out = np.zeros((k // per, n), dtype=np.int64)
    for r in range(k // per):
        for c in range(n):
            word = 0
            for j in range(per):
                word |= int(codes[per * r + j, c]) << (bits * j)
            out[r, c] = word
    return out.astype(np.uint32).view(np.int32)


def pack_along_cols(values: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    """qzeros (and AWQ qweight): int32 [R, C*bits/32]; slot j of word [r, c] holds column p*c + order[j]."""
    per = 32 // bits
    order = order or list(range(per))
    rows, cols = values.shape
    out = np.zeros((rows, cols // per), dtype=np.int64)
    for r in range(rows):
        for c in range(cols // per):
            word = 0
            for j in range(per):
                word |= (int(values[r, per * c + order[j]]) & ((1 << bits) - 1)) << (bits * j)
            out[r, c] = word
    return out.astype(np.uint32).view(np.int32)


def expected_weights(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float64) - zeros[g_idx].astype(np.float64)) * scales[g_idx].astype(np.float64)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(params=["cpu", "reference"])
def backend(request: pytest.FixtureRequest):
    """The real CPU backend, and a host backend without kernels (the float64 reference path)."""
    if request.param == "cpu":
        return request.getfixturevalue("cpu")
    from halfakes import HostBackend

    from hal_core.ops import Ops

    return Ops.attach(HostBackend()).backend


def act_order_g_idx(rng: np.random.Generator, k: int, group_size: int) -> np.ndarray:
    """GPTQ act-order: rows quantised in permuted order, group i // G for the i-th row processed."""
    perm = rng.permutation(k)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group_size
    return g_idx


# -- GPTQ ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_dequantizes_exactly(rng: np.random.Generator, fmt: str, act_order: bool, bits: int) -> None:
    """GPTQ v1 (zero - 1 stored) and v2 tensors, with and without g_idx, give (q - z) * s exactly."""
    k, n, g = 128, 64, 32
    qmax = (1 << bits) - 1
    codes = rng.integers(0, qmax + 1, size=(k, n))
    low = 1 if fmt == "gptq" else 0  # v1 cannot store a true zero of 0
    zeros = rng.integers(low, qmax + 1, size=(k // g, n))
    scales = (rng.random((k // g, n)) * 0.1 + 0.01).astype(np.float16)
    g_idx = act_order_g_idx(rng, k, g) if act_order else np.arange(k, dtype=np.int32) // g
    stored = zeros - 1 if fmt == "gptq" else zeros
    qw = from_gptq(pack_along_rows(codes, bits), pack_along_cols(stored, bits), scales,
                   g_idx, bits=bits, checkpoint_format=fmt)
    assert isinstance(qw, QuantizedWeight)
    assert (qw.shape, qw.group_size, qw.bits) == ((k, n), g, bits)
    assert (qw.g_idx is not None) == act_order  # a trivial g_idx is dropped
    np.testing.assert_array_equal(qw.codes(), codes)
    np.testing.assert_array_equal(qw.dequantize(np.float64), expected_weights(codes, zeros, scales, g_idx))


def test_gptq_v1_reads_nibble_15_as_zero_point_16(rng: np.random.Generator) -> None:
    """v1 stores z - 1, so a stored 15 is a true zero point of 16 (uint8 holds it)."""
    k, n = 32, 8  # one group
    codes = rng.integers(0, 16, size=(k, n))
    zeros = np.full((1, n), 16)
    scales = np.ones((1, n), np.float16)
    qw = from_gptq(pack_along_rows(codes, 4), pack_along_cols(zeros - 1, 4), scales)
    np.testing.assert_array_equal(qw.zeros, zeros)
    np.testing.assert_array_equal(qw.dequantize(), codes - 16.0)


def test_gptq_symmetric_checkpoint_stores_no_zero_points(rng: np.random.Generator) -> None:
    """A sym=True v1 layer (every stored zero 7) becomes hal's symmetric format; symmetric=False keeps zeros."""
    k, n, g = 64, 16, 16
    codes = rng.integers(0, 16, size=(k, n))
    stored = np.full((k // g, n), 7)
    scales = rng.random((k // g, n)).astype(np.float32)
    args = (pack_along_rows(codes, 4), pack_along_cols(stored, 4), scales)
    qw = from_gptq(*args)
    assert qw.symmetric and qw.zeros is None
    kept = from_gptq(*args, symmetric=False)
    np.testing.assert_array_equal(kept.zeros, np.full((k // g, n), 8))
    np.testing.assert_array_equal(qw.dequantize(), kept.dequantize())
    with pytest.raises(ValueError, match="not all 8"):
        from_gptq(*args, checkpoint_format="gptq_v2", symmetric=True)


def test_gptq_accepts_torch_tensors(rng: np.random.Generator) -> None:
    """torch tensors (int32 words, fp16/bf16 scales) import like numpy arrays (an offline copy)."""
    torch = pytest.importorskip("torch")
    k, n, g = 64, 16, 32
    codes = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(1, 16, size=(k // g, n))
    scales = (rng.random((k // g, n)) + 0.5).astype(np.float32)
    g_idx = act_order_g_idx(rng, k, g)
    qweight, qzeros = pack_along_rows(codes, 4), pack_along_cols(zeros - 1, 4)
    for dtype in (torch.float16, torch.bfloat16):
        ts = torch.from_numpy(scales).to(dtype)
        qw = from_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), ts, torch.from_numpy(g_idx))
        want = expected_weights(codes, zeros, ts.float().numpy(), g_idx)
        np.testing.assert_array_equal(qw.dequantize(), want)


def test_gptq_bad_tensors_name_the_argument() -> None:
    """Wrong dtypes, shapes, formats and g_idx values raise errors naming the argument."""
    qweight = np.zeros((8, 16), np.int32)  # K = 64
    qzeros = np.zeros((2, 2), np.int32)
    scales = np.ones((2, 16), np.float16)
    with pytest.raises(ValueError, match="checkpoint_format"):
        from_gptq(qweight, qzeros, scales, checkpoint_format="gptq_v3")
    with pytest.raises(TypeError, match="'qweight'"):
        from_gptq(qweight.astype(np.float32), qzeros, scales)
    with pytest.raises(ValueError, match="'qzeros'"):
        from_gptq(qweight, np.zeros((2, 3), np.int32), scales)
    with pytest.raises(ValueError, match="'scales'"):
        from_gptq(qweight, qzeros, np.ones((3, 16), np.float16))
    with pytest.raises(ValueError, match="'g_idx'"):
        from_gptq(qweight, qzeros, scales, np.full(64, 2, np.int32))
    with pytest.raises(ValueError, match="'bits'"):
        from_gptq(qweight, qzeros, scales, bits=3)


def _gptq_layer(n: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A valid symmetric v1 layer with K = 64, G = 32 and ``n`` columns (zero points stored as 7)."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, size=(64, n))
    qzeros = pack_along_cols(np.full((2, n), 7), 4) if n % 8 == 0 else np.full((2, n // 8), 0x77777777, np.int32)
    return pack_along_rows(codes, 4), qzeros, np.ones((2, n), np.float16)


@pytest.mark.parametrize("g_idx", [np.arange(64, dtype=np.float32) // 32, np.zeros(64, bool),
                                   np.arange(64, dtype=np.float64) // 32 + 0.5],
                         ids=["float", "bool", "fractional"])
def test_gptq_refuses_a_non_integer_g_idx(g_idx: np.ndarray) -> None:
    """g_idx must hold integers: a float or bool array (once silently truncated) is a TypeError naming it."""
    with pytest.raises(TypeError, match="'g_idx': expected an integer array"):
        from_gptq(*_gptq_layer(), g_idx)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_checkpoint_scales_must_be_finite(bad: float) -> None:
    """A NaN or infinite scale (GPTQ or AWQ) is refused naming 'scales', with the index of the first one."""
    qweight, qzeros, scales = _gptq_layer()
    scales[1, 5] = bad
    with pytest.raises(ValueError, match=r"'scales': expected finite values.*\(1, 5\)"):
        from_gptq(qweight, qzeros, scales)
    awq_scales = np.ones((1, 8), np.float32)
    awq_scales[0, 2] = bad
    with pytest.raises(ValueError, match="'scales': expected finite"):
        from_awq(np.zeros((8, 1), np.int32), np.zeros((1, 1), np.int32), awq_scales)


def test_gptq_n_must_be_a_multiple_of_the_zero_packing() -> None:
    """N = 12 cannot be packed 8 zero points per word along N: refused naming 'qweight', not read as 8 columns."""
    qweight, qzeros, scales = _gptq_layer(n=12)
    with pytest.raises(ValueError, match=r"'qweight': N=12 .* multiple of 8"):
        from_gptq(qweight, qzeros, scales)


def test_gptq_wrongly_typed_arguments_name_themselves() -> None:
    """bits, checkpoint_format, zero_point_offset and symmetric of the wrong type raise TypeError naming them."""
    layer = _gptq_layer()
    cases = [({"bits": 4.0}, "bits"), ({"bits": True}, "bits"), ({"checkpoint_format": 1}, "checkpoint_format"),
             ({"zero_point_offset": 1.5}, "zero_point_offset"), ({"symmetric": "yes"}, "symmetric")]
    for kwargs, name in cases:
        with pytest.raises(TypeError, match=repr(name)):
            from_gptq(*layer, **kwargs)
    with pytest.raises(TypeError, match="'scales'"):
        from_gptq(layer[0], layer[1], layer[2].astype(np.complex64))
    with pytest.raises(TypeError, match="'qzeros'"):
        from_gptq(layer[0], [[0, 0]], layer[2])
    with pytest.raises(TypeError, match="'symmetric'"):
        from_awq(np.zeros((8, 1), np.int32), np.zeros((1, 1), np.int32), np.ones((1, 8), np.float16), symmetric=1)


def test_gptq_numpy_integer_scalars_work_like_ints() -> None:
    """bits and zero_point_offset may be numpy integer scalars or 0-d arrays."""
    layer = _gptq_layer()
    want = from_gptq(*layer)
    assert from_gptq(*layer, bits=np.int64(4), zero_point_offset=np.array(1)) == want
    assert from_gptq(*layer, bits=np.array(4, np.int32), symmetric=np.bool_(True)) == want


# -- AWQ ----------------------------------------------------------------------------------------


def test_awq_dequantizes_exactly(rng: np.random.Generator) -> None:
    """AWQ's interleaved nibble order [0,2,4,6,1,3,5,7] in qweight and qzeros unpacks to (q - z) * s."""
    k, n, g = 128, 64, 64
    codes = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(0, 16, size=(k // g, n))
    scales = (rng.random((k // g, n)) * 0.1 + 0.01).astype(np.float16)
    qw = from_awq(pack_along_cols(codes, 4, AWQ_ORDER), pack_along_cols(zeros, 4, AWQ_ORDER), scales)
    assert (qw.shape, qw.group_size, qw.g_idx) == ((k, n), g, None)
    np.testing.assert_array_equal(qw.codes(), codes)
    np.testing.assert_array_equal(qw.dequantize(), expected_weights(codes, zeros, scales, np.arange(k) // g))


def test_awq_order_matters(rng: np.random.Generator) -> None:
    """Reading AWQ words in plain order would be wrong: the import must undo the interleave."""
    codes = np.tile(np.arange(8), (8, 1))  # column c holds code c
    qw = from_awq(pack_along_cols(codes, 4, AWQ_ORDER), np.full((1, 1), 0x88888888 - 2**32, np.int32),
                  np.ones((1, 8), np.float16))
    np.testing.assert_array_equal(qw.codes(), codes)
    assert qw.symmetric  # every zero point 8


# -- malformed tensors: each names its argument, before any word is unpacked ---------------------------


def _awq_layer() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A valid AWQ layer with K = 8, N = 8 and one group: qweight [8, 1], qzeros [1, 1], scales [1, 8]."""
    return np.zeros((8, 1), np.int32), np.zeros((1, 1), np.int32), np.ones((1, 8), np.float16)


def _meta_qweight() -> object:
    torch = pytest.importorskip("torch", reason="torch is not installed (make test installs it)")
    return torch.zeros(8, 16, dtype=torch.int32, device="meta")


MALFORMED = {  # name: (importer, {argument: replacement}, keyword arguments, error type, message)
    "gptq-qweight-1d": (from_gptq, {"qweight": np.zeros(128, np.int32)}, {}, ValueError,
                        "'qweight': expected 2 dimensions"),
    "gptq-qweight-no-rows": (from_gptq, {"qweight": np.zeros((0, 16), np.int32)}, {}, ValueError,
                             "'qweight'.*K=0 .*at least 1"),
    "gptq-qweight-no-columns": (from_gptq, {"qweight": np.zeros((8, 0), np.int32)}, {}, ValueError,
                                "'qweight'.*N=0 .*at least 1"),
    "gptq-qweight-meta": (from_gptq, {"qweight": "META"}, {}, TypeError, "'qweight': a tensor on the meta device"),
    "gptq-qzeros-float": (from_gptq, {"qzeros": np.zeros((2, 2), np.float32)}, {}, TypeError,
                          "'qzeros': expected int32"),
    "gptq-qzeros-3d": (from_gptq, {"qzeros": np.zeros((2, 2, 1), np.int32)}, {}, ValueError,
                       "'qzeros': expected 2 dimensions"),
    "gptq-scales-1d": (from_gptq, {"scales": np.ones(16, np.float16)}, {}, ValueError,
                       r"'scales': expected shape \[K/G, 16\]"),
    "gptq-scales-int": (from_gptq, {"scales": np.ones((2, 16), np.int32)}, {}, TypeError,
                        "'scales': expected float16"),
    "gptq-g_idx-2d": (from_gptq, {"g_idx": np.zeros((64, 1), np.int32)}, {}, ValueError,
                      r"'g_idx': expected shape \(64,\)"),
    "gptq-g_idx-list": (from_gptq, {"g_idx": [0] * 64}, {}, TypeError, "'g_idx': expected an array"),
    "gptq-zero-offset": (from_gptq, {}, {"zero_point_offset": 300}, ValueError,
                         "'qzeros': the true zero points .* lie in 307..307"),
    "awq-k-not-multiple-of-8": (from_awq, {"qweight": np.zeros((12, 1), np.int32)}, {}, ValueError,
                                "'qweight': K=12 rows .*multiple of 8"),
    "awq-qweight-float": (from_awq, {"qweight": np.zeros((8, 1), np.float32)}, {}, TypeError,
                          "'qweight': expected int32"),
    "awq-qweight-no-rows": (from_awq, {"qweight": np.zeros((0, 1), np.int32)}, {}, ValueError,
                            "'qweight'.*at least 1"),
    "awq-qzeros-shape": (from_awq, {"qzeros": np.zeros((2, 1), np.int32)}, {}, ValueError,
                         r"'qzeros': expected shape \(1, 1\)"),
    "awq-scales-n": (from_awq, {"scales": np.ones((1, 16), np.float16)}, {}, ValueError,
                     r"'scales': expected shape \[K/G, 8\]"),
    "awq-scales-groups": (from_awq, {"scales": np.ones((3, 8), np.float16)}, {}, ValueError,
                          "'scales': 3 groups do not divide K=8"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tensors_name_the_argument_before_any_unpacking(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrong dtype, rank or shape of any tensor: TypeError/ValueError naming it; no word is unpacked first."""
    import hal_core.quant.awq as awq
    import hal_core.quant.gptq as gptq

    def unpacked(*args: object, **kwargs: object) -> None:
        raise AssertionError("packed words were unpacked before every argument was checked")

    importer, replace, kwargs, error, match = MALFORMED[case]
    names = ["qweight", "qzeros", "scales"]
    arguments = dict(zip(names, _gptq_layer() if importer is from_gptq else _awq_layer(), strict=True))
    arguments |= {k: _meta_qweight() if isinstance(v, str) else v for k, v in replace.items()}
    monkeypatch.setattr(gptq, "unpack_rows", unpacked)
    if case != "gptq-zero-offset":  # the zero points' range is a check on their unpacked values
        monkeypatch.setattr(awq, "unpack_cols", unpacked)
        monkeypatch.setattr(gptq, "unpack_cols", unpacked)
    with pytest.raises(error, match=match):
        importer(**arguments, **kwargs)


# -- through the op -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["gptq-act-order", "gptq-v2", "awq"])
def test_imported_weights_through_quantized_gemm(backend, rng: np.random.Generator, kind: str, dtype) -> None:
    """quantized_gemm with imported GPTQ/AWQ weights matches x @ ((q - z) * s) in float64."""
    k, n, g, m = 256, 96, 64, 5
    codes = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(1, 16, size=(k // g, n))
    scales = (rng.random((k // g, n)) * 0.02 + 0.005).astype(np.float16)
    g_idx = np.arange(k) // g
    if kind == "awq":
        qw = from_awq(pack_along_cols(codes, 4, AWQ_ORDER), pack_along_cols(zeros, 4, AWQ_ORDER), scales)
    elif kind == "gptq-v2":
        qw = from_gptq(pack_along_rows(codes, 4), pack_along_cols(zeros, 4), scales, checkpoint_format="gptq_v2")
    else:
        g_idx = act_order_g_idx(rng, k, g)
        qw = from_gptq(pack_along_rows(codes, 4), pack_along_cols(zeros - 1, 4), scales, g_idx)
    x = rng.standard_normal((m, k)).astype(dtype)
    want = x.astype(np.float64) @ expected_weights(codes, zeros, scales, g_idx)
    got = backend.ops.quantized_gemm(x, qw)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
