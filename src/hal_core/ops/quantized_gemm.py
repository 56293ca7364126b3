"""``quantized_gemm``: activations ``x [M, K]`` times a :class:`~hal_core.quant.QuantizedWeight` ``[K, N]``.

- ``bits=4``, ``activations`` None or ``'float'`` (W4A16): ``y = x @ dequantize(w)``,
  activations kept in float.
- ``bits=4``, ``activations='auto'``: the backend chooses per call (:meth:`QuantizedGemm.settle`):
  int8 activations (W4A8) from ``M >= INT8_ACTIVATIONS_FROM_M`` rows where the backend declares
  W4A8 and the device has int8 dot products (capability feature ``int8_dot``), float below (a
  decode step keeps W4A16's accuracy, batches and prompts get integer dot products) and on a device
  without them (there W4A8's integer sums run in plain arithmetic, slower than W4A16 at every M);
  ``hal tune`` replaces the choice per shape bucket on a device, ``hal info --explain`` says what
  was chosen and why.
- ``bits=4``, ``activations='int8'`` (W4A8) and ``bits=8`` whatever ``activations``
  says (W8A8): activations are quantised per token first
  (:func:`~hal_core.quant.quantize_activations`, in float32: ``sx = amax / 127``,
  ``xq = rint(x / sx)`` rounded half to even, clipped to [-127, 127]), then
  ``y[m, n] = sx[m] * sum_k xq[m, k] * w[k, n]`` with ``w`` the dequantised weight.

Non-finite activations (docs/quantization.md): with int8 activations a row
of ``x`` holding any NaN or infinity gives an all-NaN output row (its scale
is NaN); in W4A16 IEEE arithmetic decides, as in :meth:`QuantizedGemm.reference`.

The output has ``x``'s dtype; accumulation is at least fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import DTYPE_NAMES, dtype_name, is_c_contiguous, numpy_dtype
from ..quant import QuantizedWeight, quantize, quantize_activations
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import fail, host_index_checks
from ._declare import Arg, BenchCases, Feature, Output
from ._inputs import uniform
from ._spec import OpSpec

__all__ = ["ACTIVATIONS", "INT8_ACTIVATIONS_FROM_M", "QuantizedGemm", "activation_candidates", "activation_rule",
           "check_weight_layout", "gemm_dtypes", "int8_activations", "quantized_gemm_inputs", "random_weight", "scheme"]

#: dtypes quantized_gemm accepts for activations.
gemm_dtypes = ("fp16", "bf16", "fp32")
#: The ``activations`` settings: int4 weights times float activations (W4A16), per-token int8 ones (W4A8), or
#: the backend's choice by the number of rows (``"auto"``).
ACTIVATIONS = ("float", "int8", "auto")
#: ``activations="auto"`` quantises an int4 layer's activations to int8 from this many rows up (where the backend
#: declares W4A8). Measured with hal-cpu on AVX-512 VNNI (2 threads; K x N = 4096 x 4096 and 4096 x 11008, G = 128;
#: bf16 and fp32 activations; docs/quantization.md): at M = 1 both run in the same time (W4A16 / W4A8 = 0.96-1.03)
#: and W4A16 is the more accurate; from M = 2 W4A8 is 1.4-1.7x faster, 2.0-2.9x from M = 4.
INT8_ACTIVATIONS_FROM_M = 2


def int8_activations(args: Mapping[str, Any]) -> bool:
    """Whether a validated call quantises its activations to int8 (W8A8, or W4A8 by ``activations='int8'``;
    ``'auto'`` counts as float until :meth:`QuantizedGemm.settle` replaces it)."""
    return int(args["qweight"].bits) == 8 or args.get("activations") == "int8"


def activation_candidates(bits: int, coverage: Any, weights: str) -> tuple[tuple[str, ...], str] | None:
    """What ``activations="auto"`` may choose for ``bits``-bit ``weights`` (named so in the reason) under a
    backend's ``coverage``, with why; None where both ``"float"`` and ``"int8"`` remain. Shared by the ops whose
    int4 GEMMs take the setting (``quantized_gemm``, ``fused_moe``)."""
    if bits == 8:
        return ("int8",), f"int8 {weights} always run W8A8"
    if "w4a8" not in (coverage.allowed.get("schemes") or ()):
        return ("float",), "the backend does not declare W4A8 (OpCoverage schemes)"
    return None


def activation_rule(rows: int, features: frozenset[str], label: str) -> tuple[str, str]:
    """The built-in choice of ``activations="auto"`` for a call of ``rows`` rows (``label`` names them in the
    reason): int8 from :data:`INT8_ACTIVATIONS_FROM_M` up where the device has int8 dot products (feature
    ``int8_dot``), float below and on every other device."""
    if "int8_dot" not in features:
        return "float", "the device has no int8 dot products (capability feature 'int8_dot'): W4A16 is faster"
    if rows >= INT8_ACTIVATIONS_FROM_M:
        return "int8", f"{label} = {rows} >= {INT8_ACTIVATIONS_FROM_M} (the built-in rule)"
    return "float", f"{label} = {rows} < {INT8_ACTIVATIONS_FROM_M} (the built-in rule)"


def scheme(args: Mapping[str, Any]) -> str:
    """The call's arithmetic: ``'w4a16'``, ``'w4a8'`` or ``'w8a8'`` (the ``scheme`` coverage feature)."""
    bits = int(args["qweight"].bits)
    return f"w{bits}a8" if int8_activations(args) else f"w{bits}a16"


class QuantizedGemm(OpSpec):
    """Activations times a group-wise int4 (W4A16) or int8 (W8A8) quantized weight."""

    name = "quantized_gemm"
    args = (
        Arg.array("x", "[M, K]", dtypes=gemm_dtypes),
        Arg.weight("qweight", "[K, N]", doc="from hal_core.quant.quantize (or a GPTQ/AWQ import)"),
        Arg.out(),
        Arg.choice("activations", ACTIVATIONS,
                   doc="int4 weights: 'float' (W4A16, the default), 'int8' (W4A8: x quantised per token) or "
                       "'auto' (int8 from INT8_ACTIVATIONS_FROM_M rows where the backend declares W4A8 and "
                       "the device has int8 dot products); "
                       "int8 weights always run W8A8"),
    )
    auto_settings: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({"activations": ("float", "int8")})
    output = Output("[M, N]", dtype_of="x")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["x"])),
        Feature("group_size", "group_sizes", lambda args: int(args["qweight"].group_size)),
        Feature("bits", "bits", lambda args: int(args["qweight"].bits)),
        Feature("scheme", "schemes", scheme, opt_in=("w4a8",),
                doc="'w4a16', 'w4a8' or 'w8a8'; W4A8 runs only on a backend that declares it (else it falls back)"),
    )

    def check_layout(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        check_weight_layout(args["qweight"])

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        qw: QuantizedWeight = args["qweight"]
        if qw.g_idx is not None and sizes["K"] and host_index_checks(qw.g_idx):
            self.check_index_values(args)

    def auto_candidates(self, name: str, args: Mapping[str, Any], coverage: Any) -> tuple[tuple[str, ...], str]:
        """``activations="auto"``: int8 weights always run W8A8; int4 ones choose where the backend declares W4A8."""
        return activation_candidates(int(args["qweight"].bits), coverage, "weights") or (self.auto_settings[name], "")

    def auto_rule(self, name: str, args: Mapping[str, Any], features: frozenset[str]) -> tuple[str, str]:
        """int8 activations from :data:`INT8_ACTIVATIONS_FROM_M` rows up where the device has int8 dot products
        (feature ``int8_dot``), float below and on every other device."""
        return activation_rule(int(args["x"].shape[0]), features, "M")

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Range of the host ``qweight.g_idx`` (a device one is checked once copied to the host, see below).

        No GPU kernel reads ``g_idx``: device act-order weights run on the
        fallback path, which copies them to the host and checks them there.
        """
        qw = args["qweight"]
        k = qw.shape[0]
        if qw.g_idx is None or not k:
            return
        groups = np.asarray(qw.g_idx)
        bad = (groups < 0) | (groups >= k // qw.group_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise fail("qweight.g_idx", f"group indices in [0, {k // qw.group_size})",
                       f"g_idx[{i}] = {int(groups[i])}")

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``w<bits>:m<pow2 M>`` (``w4a8:m<pow2 M>`` with int4 weights and int8 activations)."""
        kind = "w4a8" if scheme(args) == "w4a8" else f"w{args['qweight'].bits}"
        return f"{kind}:m{pow2(args['x'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        m = args["x"].shape[0]
        k, n = args["qweight"].shape
        return 2 * m * k * n

    def nbytes(self, args: Mapping[str, Any]) -> int:
        x = args["x"]
        m = x.shape[0]
        n = args["qweight"].shape[1]
        return args["qweight"].nbytes + x.dtype.itemsize * (int(np.prod(x.shape)) + m * n)

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        if args.get("activations") == "auto" and int(args["qweight"].bits) == 4:
            raise ArgumentError("argument 'activations': 'auto' is chosen by a backend's front door; the reference "
                                "takes 'float' or 'int8' (backend.ops.prepare(...).args holds the choice)")
        qw: QuantizedWeight = args["qweight"]
        w = qw.dequantize(np.float64)
        x = np.asarray(args["x"])
        if int8_activations(args):  # rows holding NaN or inf have a NaN scale: NaN rows (quantize_activations)
            xq, sx = quantize_activations(x)
            return sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ w)
        with np.errstate(invalid="ignore", over="ignore"):  # IEEE arithmetic: inf * 0 is NaN
            return x.astype(np.float64) @ w


def check_weight_layout(qw: QuantizedWeight, name: str = "qweight") -> None:
    """ArgumentTypeError / ArgumentError naming the first array of ``qw`` (argument ``name``) of the wrong dtype or
    layout; nothing read but dtypes and strides."""
    if not _host_arrays_fit(qw):  # the checks below name what does not fit
        _check_weight_arrays(qw, name)


def _host_arrays_fit(qw: QuantizedWeight) -> bool:
    """Whether every array of ``qw`` is a C-contiguous numpy array of the dtype its field takes (the common case)."""
    for value, want in ((qw.qweight, "uint32" if qw.bits == 4 else "uint8"), (qw.scales, None),
                        (qw.zeros, "uint8"), (qw.g_idx, "int32")):
        if value is None:
            continue
        if type(value) is not np.ndarray or not value.flags.c_contiguous:
            return False
        name = DTYPE_NAMES.get(value.dtype)
        if name not in ((want,) if want is not None else ("fp16", "fp32", "bf16")):
            return False
    return True


def _check_weight_arrays(qw: QuantizedWeight, arg: str) -> None:
    """ArgumentTypeError / ArgumentError naming the first array of ``qw`` of the wrong dtype or layout."""
    expected = {"qweight": "uint32" if qw.bits == 4 else "uint8", "zeros": "uint8", "g_idx": "int32"}
    for name, value in qw.arrays().items():
        want = expected.get(name)
        if want and dtype_name(value) != want:
            raise ArgumentTypeError(f"argument '{arg}.{name}': expected dtype {want}, got {dtype_name(value)}")
        if not is_c_contiguous(value):
            raise fail(f"{arg}.{name}", "a C-contiguous array", f"strides {getattr(value, 'strides', '?')}")
    if dtype_name(qw.scales) not in ("fp16", "fp32", "bf16"):
        raise ArgumentTypeError(f"argument '{arg}.scales': expected dtype fp16, bf16 or fp32, "
                                f"got {dtype_name(qw.scales)}")


def quantized_gemm_inputs(
    rng: np.random.Generator,
    *,
    m: int,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    dtype: str,
    act_order: bool = False,
) -> dict[str, Any]:
    """Host arguments: ``x`` in [-1, 1], weights ~ N(0, 1/K), quantised (``act_order``: a random ``g_idx``)."""
    x = rng.uniform(-1.0, 1.0, size=(m, k)).astype(numpy_dtype(dtype))
    weight = rng.standard_normal((k, n)) / np.sqrt(k)
    qweight: QuantizedWeight = quantize(weight, bits=bits, group_size=group_size, symmetric=symmetric)
    if act_order:
        g_idx = rng.permutation(np.arange(k) // group_size).astype(np.int32)
        qweight = QuantizedWeight(qweight.qweight, qweight.scales, qweight.zeros, qweight.bits,
                                  qweight.group_size, qweight.shape, g_idx=g_idx)
    return {"x": x, "qweight": qweight}


def random_weight(rng: np.random.Generator, k: int, n: int, bits: int, group: int) -> QuantizedWeight:
    """A symmetric group-wise weight with uniform random codes and scales in [0.001, 0.011) (fast, no quantiser)."""
    if bits == 4:
        packed = rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint32)
    else:
        packed = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
    scales = (rng.random((k // group, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
    return QuantizedWeight(qweight=packed, scales=scales, zeros=None, bits=bits, group_size=group, shape=(k, n))


def _check_case(p: Mapping[str, Any]) -> str | None:
    if p["bits"] not in (4, 8):
        return f"bits must be 4 or 8, got {p['bits']}"
    if p["abits"] not in (8, 16, 0):
        return (f"abits (activation bits, 16: float, 8: int8, 0: 'auto'; bits=8 always runs W8A8) must be 16, 8 "
                f"or 0, got {p['abits']}")
    if p["k"] % p["group"] or (p["bits"] == 4 and p["k"] % 8):
        return f"K={p['k']} must be a multiple of group={p['group']} (and of 8 for bits=4)"
    return None


def _label(p: Mapping[str, Any]) -> str:
    kind = "W8A8" if p["bits"] == 8 else f"W4A{p['abits'] or '-auto'}"
    return f"{kind} G{p['group']} M={p['m']} {p['k']}x{p['n']} {p['dtype']}"


def _gemm(m: int, k: int, n: int, bits: int, dtype: str = "fp16", abits: int = 16) -> dict[str, Any]:
    return {"m": m, "k": k, "n": n, "bits": bits, "abits": abits, "group": 128, "dtype": dtype}


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    args = {"x": uniform(rng, (p["m"], p["k"]), p["dtype"]),
            "qweight": random_weight(rng, p["k"], p["n"], p["bits"], p["group"])}
    return {**args, **_activations(p)}


def _activations(p: Mapping[str, Any]) -> dict[str, str]:
    """The ``activations`` argument of a case: none for W4A16 and W8A8, ``'int8'`` for ``abits=8``, else ``'auto'``."""
    if p["bits"] != 4 or p.get("abits", 16) == 16:
        return {}
    return {"activations": "int8" if p["abits"] == 8 else "auto"}


#: The ``gemm`` preset's batch sizes: decode (M = 1), batched decode (2..64, still bound by the weight bytes at
#: first) and compute-bound prompt-sized M.
GEMM_SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 256, 512)

#: The ``gemm`` preset's formats as ``(bits, abits)``: W4A16, W4A8 (int8 activations) and W8A8.
GEMM_FORMATS = ((4, 16), (4, 8), (8, 16))


def _gemm_cases() -> list[dict[str, Any]]:
    shapes = ((4096, 11008), (11008, 4096))
    cases = [_gemm(m, k, n, bits, abits=abits) for bits, abits in GEMM_FORMATS for k, n in shapes
             for m in GEMM_SWEEP_M]
    # W4A16 small M also with bf16 activations, the dtype torch's int4 peer runs: the like-for-like comparison.
    return cases + [_gemm(m, k, n, 4, "bf16") for k, n in shapes for m in (1, 16)]


def _w4a8_cases() -> list[dict[str, Any]]:
    """W4A16 beside W4A8 at M = 1 .. 64 for 4096 x 4096 and 4096 x 11008 (where integer dot products may pay)."""
    shapes = ((4096, 4096), (4096, 11008))
    return [_gemm(m, k, n, 4, abits=abits) for k, n in shapes for m in (1, 2, 4, 8, 16, 32, 64) for abits in (16, 8)]


QuantizedGemm.bench = BenchCases(
    params={"m": 1, "k": 4096, "n": 11008, "bits": 4, "abits": 16, "group": 128, "dtype": "fp16"},
    aliases={"group_size": "group"},
    may_be_zero=frozenset({"abits"}),
    label=_label,
    check=_check_case,
    inputs=_bench_inputs,
    presets={"prefill": lambda: [_gemm(512, 4096, 4096, bits) for bits in (4, 8)], "gemm": _gemm_cases,
             "w4a8": _w4a8_cases},
    explain=({"dtype": "fp16", "m": 1, "k": 4096, "n": 4096, "bits": 4, "group": 128},
             {"dtype": "bf16", "m": 256, "k": 1024, "n": 1024, "bits": 4, "group": 64},
             {"dtype": "fp16", "m": 16, "k": 1024, "n": 1024, "bits": 8, "group": 128},
             {"dtype": "bf16", "m": 1, "k": 4096, "n": 4096, "bits": 4, "abits": 0, "group": 128},
             {"dtype": "bf16", "m": 8, "k": 4096, "n": 4096, "bits": 4, "abits": 0, "group": 128}),
    test_inputs=lambda rng, p: {**quantized_gemm_inputs(rng, m=p["m"], k=p["k"], n=p["n"], bits=p["bits"],
                                                        group_size=p["group"], symmetric=True, dtype=p["dtype"]),
                                **_activations(p)},
    tiny={"m": 1, "k": 64, "n": 16, "bits": 4, "group": 32, "dtype": "fp32"},
)

register_op(QuantizedGemm())
