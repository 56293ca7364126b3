"""quantized_gemm's ``activations`` setting: the W4A8 reference, its validation, coverage and torch operator."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import host, tensor, torch

import hal_core
import hal_core.torch as hal_torch
from hal_core import ArgumentError, ArgumentTypeError, FallbackError, bench
from hal_core.ops import OPS, Arg, OpCoverage
from hal_core.testing.inputs import quantized_gemm_inputs

SPEC = OPS["quantized_gemm"]


def _args(seed: int, *, bits: int = 4, m: int = 5, k: int = 128, n: int = 24, group: int = 32,
          symmetric: bool = False, dtype: str = "fp32") -> dict:
    print(f"seed={seed}")
    return quantized_gemm_inputs(np.random.default_rng(seed), m=m, k=k, n=n, bits=bits, group_size=group,
                                 symmetric=symmetric, dtype=dtype)


def _w4a8_by_hand(x: np.ndarray, qweight: hal_core.quant.QuantizedWeight) -> np.ndarray:
    """sx * (xq @ w) with xq, sx computed here in float32 (amax / 127, round half to even, clip to +-127)."""
    x32 = np.asarray(x, dtype=np.float32)
    sx = np.abs(x32).max(axis=1) / np.float32(127.0)
    xq = np.clip(np.rint(x32 / sx[:, None]), -127, 127)
    return sx.astype(np.float64)[:, None] * (xq @ qweight.dequantize(np.float64))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_reference_quantises_activations_per_token_with_int4_weights(dtype: str) -> None:
    """activations='int8' with int4 weights: the reference is sx * (xq @ dequantize(w)), xq rounded half to even."""
    args = _args(10, dtype=dtype)
    got = SPEC.reference({**args, "activations": "int8"})
    np.testing.assert_allclose(got, _w4a8_by_hand(args["x"], args["qweight"]), rtol=1e-12, atol=1e-12)
    float_ref = SPEC.reference(args)
    assert not np.array_equal(got, float_ref)  # the setting changes the arithmetic
    assert np.array_equal(SPEC.reference({**args, "activations": "float"}), float_ref)


def test_int8_weights_run_w8a8_whatever_the_setting() -> None:
    """bits=8: 'float', 'int8' and None give the same (W8A8) reference and the same CPU result, bit for bit."""
    args = _args(11, bits=8)
    refs = [SPEC.reference({**args, "activations": a}) for a in (None, "float", "int8")]
    assert np.array_equal(refs[0], refs[1]) and np.array_equal(refs[0], refs[2])
    cpu = hal_core.get_backend("cpu")
    outs = [cpu.ops.quantized_gemm(args["x"], args["qweight"], activations=a) for a in (None, "float", "int8")]
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_default_is_w4a16_bit_for_bit() -> None:
    """No setting and activations='float' run the same W4A16 kernel: identical bits."""
    args = _args(12, m=3)
    cpu = hal_core.get_backend("cpu")
    default = cpu.ops.quantized_gemm(args["x"], args["qweight"])
    assert np.array_equal(default, cpu.ops.quantized_gemm(args["x"], args["qweight"], activations="float"))


@pytest.mark.parametrize(("value", "error"), [("int4", ArgumentError), ("INT8", ArgumentError), ("", ArgumentError),
                                              (8, ArgumentTypeError), (b"int8", ArgumentTypeError)])
def test_a_bad_setting_is_refused_naming_the_argument(value: object, error: type) -> None:
    """A value outside 'float' / 'int8' / 'auto' raises before any work, naming 'activations' and the choices."""
    args = _args(13)
    out = np.full((5, 24), 7.0, dtype=np.float32)
    with pytest.raises(error, match=r"argument 'activations': expected one of \['float', 'int8', 'auto'\]"):
        hal_core.get_backend("cpu").ops.quantized_gemm(args["x"], args["qweight"], activations=value, out=out)
    assert (out == 7.0).all()


def test_arg_choice_declares_an_optional_keyword_setting() -> None:
    """Arg.choice: optional, keyword-only, a str with its choices; a declaration without string choices is refused."""
    arg = next(a for a in SPEC.args if a.name == "activations")
    assert (arg.kind, arg.required, arg.keyword_only, arg.choices) == (str, False, True, ("float", "int8", "auto"))
    assert SPEC.signature().parameters["activations"].default is None
    for bad in ((), ("a", 1)):
        with pytest.raises(ValueError, match=r"Arg\.choice"):
            Arg.choice("mode", bad)  # type: ignore[arg-type]


def test_scheme_feature_and_coverage() -> None:
    """The 'scheme' feature names W4A16 / W4A8 / W8A8; a backend declaring only W4A16 and W8A8 does not cover W4A8."""
    w4, w8 = _args(14), _args(15, bits=8)
    assert SPEC.features_of(w4)["scheme"] == "w4a16"
    assert SPEC.features_of({**w4, "activations": "int8"})["scheme"] == "w4a8"
    assert SPEC.features_of({**w8, "activations": "float"})["scheme"] == "w8a8"
    coverage = OpCoverage(schemes=("w4a16", "w8a8"))
    assert coverage.covers_call(SPEC, w4) is True and coverage.covers_call(SPEC, w8) is True
    verdict = coverage.covers_call(SPEC, {**w4, "activations": "int8"})
    assert isinstance(verdict, str) and "'w4a8' is not declared" in verdict
    # opt-in: undeclared (or left out: "any") is not enough for W4A8, naming it is
    assert "'w4a8'" in (OpCoverage().undeclared_opt_in(SPEC, {**w4, "activations": "int8"}) or "")
    assert coverage.undeclared_opt_in(SPEC, {**w4, "activations": "int8"}) is not None
    assert OpCoverage(schemes=("w4a8",)).undeclared_opt_in(SPEC, {**w4, "activations": "int8"}) is None
    assert OpCoverage().undeclared_opt_in(SPEC, w4) is None and OpCoverage().undeclared_opt_in(SPEC, w8) is None


NO_W4A8 = '''
from hal_core import API_VERSION, hookimpl
from hal_core.ops import OpCoverage
from halfakes import HostBackend, touch


def gemm(call):
    touch("{marker}")
    return call.spec.reference(call.args).astype(call.spec.output_dtype(call.args))


class NoW4a8Backend(HostBackend):
    name = "now4a8"
    priority = 5

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, priority=10, name="float-only-gemm")
        registry.declare("quantized_gemm", OpCoverage(schemes=("w4a16", "w8a8")))


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [NoW4a8Backend]
'''


def test_a_backend_without_w4a8_is_never_given_the_call(make_plugin, monkeypatch) -> None:
    """W4A8 on a backend declaring schemes w4a16/w8a8 falls back to the CPU (correct), and is an error under strict."""
    plugin = make_plugin("now4a8", NO_W4A8)
    backend = hal_core.get_backend("now4a8")
    args = _args(16)
    y = backend.ops.quantized_gemm(args["x"], args["qweight"], activations="int8")
    np.testing.assert_allclose(y, SPEC.reference({**args, "activations": "int8"}), rtol=1e-5, atol=1e-5)
    assert plugin.ran() == 0
    backend.ops.quantized_gemm(args["x"], args["qweight"])
    assert plugin.ran() == 1  # W4A16 is the backend's own
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(FallbackError, match="w4a8"):
        backend.ops.quantized_gemm(args["x"], args["qweight"], activations="int8")


def test_torch_operator_takes_the_setting() -> None:
    """torch.ops.hal.quantized_gemm has 'str? activations=None'; 'int8' gives W4A8, a bad value names the argument."""
    assert "str? activations=None" in str(torch.ops.hal.quantized_gemm.default._schema)
    args = _args(17, m=3, k=64, n=16)
    weight = hal_torch.weight_to_tensors(args["qweight"])
    x = tensor(args["x"], "cpu")
    y = hal_torch.quantized_gemm(x, weight, 4, activations="int8")
    np.testing.assert_allclose(host(y), SPEC.reference({**args, "activations": "int8"}), rtol=1e-5, atol=1e-5)
    positional = (x, weight["qweight"], weight["scales"], weight.get("zeros"), weight.get("g_idx"), 4, 32)
    direct = torch.ops.hal.quantized_gemm(*positional, activations="int8")
    assert torch.equal(direct, y)
    torch.library.opcheck(torch.ops.hal.quantized_gemm.default, positional, {"activations": "int8"})
    with pytest.raises(ArgumentError, match="'activations'"):
        torch.ops.hal.quantized_gemm(*positional, activations="fp8")


def test_bench_w4a8_preset_pairs_each_case_with_w4a16() -> None:
    """The 'w4a8' preset holds W4A16 and W4A8 at M = 1..64 on 4096x4096 and 4096x11008; W4A8 inputs ask for int8."""
    cases = bench.preset_cases("w4a8")
    for k, n in ((4096, 4096), (4096, 11008)):
        for m in (1, 2, 4, 8, 16, 32, 64):
            for abits in (16, 8):
                assert bench.make_case("quantized_gemm", m=m, k=k, n=n, bits=4, abits=abits) in cases
    case = bench.make_case("quantized_gemm", m=2, k=64, n=16, bits=4, abits=8, group=32)
    inputs = SPEC.bench.inputs(np.random.default_rng(0), case.params)
    assert inputs["activations"] == "int8" and SPEC.features_of(inputs)["scheme"] == "w4a8"
