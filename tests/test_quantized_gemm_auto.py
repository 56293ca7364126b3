"""quantized_gemm's activations="auto": W4A16 for one row, W4A8 from INT8_ACTIVATIONS_FROM_M rows where the device has
int8 dot products (feature 'int8_dot'), W4A16 at every M where it has none; tuned per bucket."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, bench, tuning
from hal_core.bench import TimingPolicy, make_case
from hal_core.cli import main
from hal_core.ops import OPS, OpCoverage, device_features
from hal_core.ops._device_features import forget_device_features
from hal_core.ops.quantized_gemm import INT8_ACTIVATIONS_FROM_M, quantized_gemm_inputs
from hal_core.testing.tolerances import tolerance

K, N, GROUP = 256, 48, 64


@pytest.fixture(autouse=True)
def store(private_tune_store: Path) -> Path:
    """A private, empty tune store for every test (the built-in rule applies unless a test persists a choice)."""
    return private_tune_store


@pytest.fixture
def cpu(int8_dot_cpu: hal_core.Backend) -> hal_core.Backend:
    """The CPU backend reporting int8 dot products (conftest's ``int8_dot_cpu``)."""
    return int8_dot_cpu


def _args(m: int, dtype: str = "fp32", bits: int = 4, seed: int = 0) -> dict:
    print(f"seed={seed} m={m} dtype={dtype} bits={bits}")
    return quantized_gemm_inputs(np.random.default_rng(seed), m=m, k=K, n=N, bits=bits, group_size=GROUP,
                                 symmetric=True, dtype=dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_auto_runs_float_for_one_row_and_int8_activations_from_the_crossover(cpu, m: int, dtype: str) -> None:
    """'auto' gives exactly the explicit setting the rule names, and that setting's float64 reference."""
    seed = 1000 + m
    args = _args(m, dtype, seed=seed)
    want = "int8" if m >= INT8_ACTIVATIONS_FROM_M else "float"
    call = cpu.ops.prepare("quantized_gemm", **args, activations="auto")
    assert call.args["activations"] == want and "built-in rule" in call.settled
    got = cpu.ops.quantized_gemm(**args, activations="auto")
    explicit = cpu.ops.quantized_gemm(**args, activations=want)
    np.testing.assert_array_equal(got.view(np.uint8), explicit.view(np.uint8))
    reference = OPS["quantized_gemm"].reference({**args, "activations": want})
    atol, rtol = tolerance("gemm", dtype)
    scale = max(1.0, float(np.abs(reference).max()))
    np.testing.assert_allclose(got.astype(np.float64), reference, atol=atol * scale, rtol=rtol)
    stats = cpu.ops.stats()["quantized_gemm"]
    assert not stats["fallbacks"], stats


@pytest.mark.parametrize("m", [1, 2, 512])
def test_auto_keeps_float_activations_on_a_device_without_int8_dot_products(plain_cpu, m: int) -> None:
    """Without 'int8_dot' W4A8's integer sums run on plain arithmetic, slower than W4A16 at every M (measured with
    that loop on an AVX2 CPU: 0.3-0.8x): 'auto' is W4A16 for every M, saying why, and gives W4A16's bits."""
    args = _args(m, "bf16", seed=2000 + m)
    call = plain_cpu.ops.prepare("quantized_gemm", **args, activations="auto")
    assert call.args["activations"] == "float" and "'int8_dot'" in call.settled
    got = plain_cpu.ops.quantized_gemm(**args, activations="auto")
    explicit = plain_cpu.ops.quantized_gemm(**args, activations="float")
    np.testing.assert_array_equal(got.view(np.uint8), explicit.view(np.uint8))


def test_the_cpu_reports_int8_dot_products_exactly_for_its_simd_kernels() -> None:
    """hal-cpu lists 'int8_dot' iff its loaded kernel variant multiplies bytes in dot-product instructions (avx512vnni:
    vpdpbusd, AMX; avx512 and avx2: vpmaddubsw), not for the baseline variant's plain loop."""
    from hal_cpu import _native

    native = _native.load()
    print(f"isa={native.isa} available={native.available}")
    cpu = hal_core.get_backend("cpu")
    assert cpu.device(0).capabilities.has("int8_dot") == (native.isa in ("avx512vnni", "avx512", "avx2"))


def test_device_features_are_read_once_and_a_broken_device_reads_as_none(caplog: pytest.LogCaptureFixture) -> None:
    """device_features caches per backend object and device; a device whose capabilities raise gives no flags,
    logged, and the call still gets the correct (float) choice."""
    class Broken:
        name = "broken"
        reads = 0

        def device(self, index: int) -> object:
            Broken.reads += 1
            raise RuntimeError("driver gone")

    broken = Broken()
    forget_device_features()
    assert device_features(broken, 0) == frozenset() and device_features(broken, 0) == frozenset()
    assert Broken.reads == 1 and "could not be read" in caplog.text
    spec = OPS["quantized_gemm"]
    args = {**_args(8), "activations": "auto"}
    assert spec.auto_rule("activations", args, device_features(broken, 0))[0] == "float"
    forget_device_features()


def test_auto_takes_what_hal_tune_persisted_for_the_bucket(cpu) -> None:
    """A persisted choice for bucket w4:m8 overrides the rule there, and only there."""
    key = tuning.key_for(cpu)
    tuning.save_table(tuning.TuneTable(key=key, knobs={"quantized_gemm": {"activations": {"w4:m8": "float"}}}))
    tuning.forget()
    eight = cpu.ops.prepare("quantized_gemm", **_args(8), activations="auto")
    assert eight.args["activations"] == "float" and "hal tune" in eight.settled
    two = cpu.ops.prepare("quantized_gemm", **_args(2), activations="auto")
    assert two.args["activations"] == "int8" and "built-in rule" in two.settled


def test_auto_never_picks_what_the_backend_leaves_to_the_fallback(cpu) -> None:
    """Without W4A8 in the coverage 'auto' is float; int8 weights are W8A8 whatever 'auto' would say."""
    spec = OPS["quantized_gemm"]
    args = {**_args(8), "activations": "auto"}
    note = spec.settle(args, cpu, 0, OpCoverage(schemes=("w4a16", "w8a8")))
    assert args["activations"] == "float" and "does not declare W4A8" in note
    args8 = {**_args(8, bits=8), "activations": "auto"}
    note = spec.settle(args8, cpu, 0, cpu.ops.coverage("quantized_gemm"))
    assert args8["activations"] == "int8" and "W8A8" in note


def test_reference_refuses_an_unsettled_auto() -> None:
    """The float64 reference needs the concrete setting: 'auto' is named in the error."""
    with pytest.raises(ArgumentError, match="activations"):
        OPS["quantized_gemm"].reference({**_args(4), "activations": "auto"})


def test_a_misspelt_setting_is_refused_naming_it(cpu) -> None:
    """An unknown activations value is an ArgumentError naming 'activations', before any work."""
    with pytest.raises(ArgumentError, match="activations"):
        cpu.ops.quantized_gemm(**_args(4), activations="int4")


def test_explain_says_what_auto_chose_and_why(cpu, capsys: pytest.CaptureFixture[str]) -> None:
    """explain's first row is the 'auto' decision; hal info --explain prints it for an abits=0 shape."""
    call = cpu.ops.prepare("quantized_gemm", **_args(8), activations="auto")
    rows = cpu.ops.explain(call)
    assert rows[0][0] == "auto" and "'int8'" in rows[0][1]
    assert any(verdict == "runs" for _, verdict in rows[1:])
    code = main(["info", "--backend", "cpu", "--explain",
                 "--shape", f"quantized_gemm:m=1,k={K},n={N},bits=4,abits=0,group={GROUP},dtype=fp32"])
    out = capsys.readouterr().out
    assert code == 0 and "activations 'auto' -> 'float': M = 1 < 2" in out


def test_tune_persists_the_activation_crossover_and_dispatch_uses_it(cpu) -> None:
    """hal tune times float against int8 activations for an int4 case and 'auto' then follows the winner."""
    case = make_case("quantized_gemm", m=8, k=K, n=N, bits=4, abits=16, group=GROUP, dtype="fp32")
    policy = TimingPolicy(repeat=3, warmup=1, min_repeat=1, max_seconds=0.05)
    report = bench.tune(cpu, [case], policy)
    settings = [d for d in report.decisions if d.kind == "setting"]
    assert [(d.op, d.bucket, d.name) for d in settings] == [("quantized_gemm", "w4:m8", "activations")]
    decision = settings[0]
    assert set(decision.ms) == {"float", "int8"} and decision.winner in ("float", "int8")
    assert decision.builtin == "int8" and report.path is not None
    call = cpu.ops.prepare("quantized_gemm", **_args(8), activations="auto")
    assert call.args["activations"] == decision.winner and "hal tune" in call.settled
