"""An op is one declaration: a toy op declared here, in one place, gets the front door, argument checks,
coverage, tuning buckets, explain, bench, and the torch operator with its fake — no other module touched."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError, bench
from hal_core.cli._explain import explain, parse_shape
from hal_core.ops import Arg, BenchCases, Feature, OpCoverage, OpImpl, Ops, OpSpec, Output, register_op, unregister_op
from hal_core.testing.inputs import assert_close

# -- the whole declaration of a new op ---------------------------------------------------------------------


class ScaleRows(OpSpec):
    """Scale each row of ``x`` by ``weights[row] * factor`` (a toy op)."""

    name = "toy_scale_rows"
    args = (
        Arg.array("x", "[rows, cols]", dtypes=("fp32", "fp16"), contiguous="last"),
        Arg.array("weights", "[rows]", dtype_of="x"),
        Arg.scalar("factor", float),
        Arg.out(),
        Arg.scalar("clip", float, required=False, minimum=0, exclusive=True, doc="clip results to [-clip, clip]"),
    )
    output = Output("[rows, cols]", dtype_of="x")
    features = (Feature("dtype", "dtypes", lambda args: str(args["x"].dtype).replace("float", "fp")),)
    bench = BenchCases(
        params={"rows": 64, "cols": 256, "dtype": "fp32"},
        label=lambda p: f"toy_scale_rows {p['dtype']} {p['rows']}x{p['cols']}",
        inputs=lambda rng, p: _inputs(rng, p),
        test_inputs=lambda rng, p: _inputs(rng, p),
        presets={"toy": lambda: [{"rows": 16, "cols": 32}, {"rows": 8, "cols": 8, "dtype": "fp16"}]},
        explain=({"rows": 4, "cols": 8},),
    )

    def bucket(self, args: Mapping[str, Any]) -> str:
        return f"r{hal_core.tuning.pow2(args['x'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        return 2 * int(np.prod(args["x"].shape))

    def nbytes(self, args: Mapping[str, Any]) -> int:
        return 2 * args["x"].nbytes

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        x = np.asarray(args["x"], dtype=np.float64)
        y = x * np.asarray(args["weights"], dtype=np.float64)[:, None] * args["factor"]
        return y if args.get("clip") is None else np.clip(y, -args["clip"], args["clip"])


def _inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    dtype = {"fp32": np.float32, "fp16": np.float16}[p["dtype"]]
    return {"x": rng.standard_normal((p["rows"], p["cols"])).astype(dtype),
            "weights": rng.standard_normal(p["rows"]).astype(dtype), "factor": 0.5}


# -- what hal derives from it ------------------------------------------------------------------------------

SEED = 20261202


@pytest.fixture
def toy() -> Iterator[ScaleRows]:
    spec = register_op(ScaleRows())
    yield spec
    unregister_op(spec.name)


@pytest.fixture
def rng() -> np.random.Generator:
    print(f"seed={SEED}")
    return np.random.default_rng(SEED)


def _kernel(call: Any) -> np.ndarray:
    """A backend's own implementation of the toy op."""
    x, w = call["x"], call["weights"]
    y = x * (w[:, None] * np.asarray(call["factor"], dtype=x.dtype))
    return y if call["clip"] is None else np.clip(y, -call["clip"], call["clip"])


def test_front_door_signature_checks_and_fallback(toy: ScaleRows, rng: np.random.Generator) -> None:
    """The cpu backend's front door gains the op: its signature, checks, and the float64 fallback."""
    backend = hal_core.get_backend("cpu")
    method = backend.ops.toy_scale_rows
    assert str(__import__("inspect").signature(method)) == "(x, weights, *, factor, out=None, clip=None)"
    assert "toy_scale_rows" in dir(backend.ops)
    args = _inputs(rng, {"rows": 5, "cols": 7, "dtype": "fp32"})
    got = method(args["x"], args["weights"], factor=0.5, clip=0.3)  # no implementation: the reference answers
    assert_close(got, toy.reference({**args, "clip": 0.3}), kind="gemm", dtype="fp32")
    out = np.full((5, 7), np.nan, np.float32)
    assert method(args["x"], args["weights"], factor=0.5, out=out) is out
    assert_close(out, toy.reference(args), kind="gemm", dtype="fp32")
    assert hal_core.stats()["cpu"][toy.name]["implementations"].get("reference", 0) >= 2
    with pytest.raises(ArgumentError, match="'weights': expected rows=5"):
        method(args["x"], args["weights"][:4], factor=0.5)
    with pytest.raises(ArgumentTypeError, match="'weights': expected dtype fp32 \\(the x's\\)"):
        method(args["x"], args["weights"].astype(np.float16), factor=0.5)
    with pytest.raises(ArgumentTypeError, match="'factor'"):
        method(args["x"], args["weights"], factor=float("nan"))
    with pytest.raises(ArgumentError, match="'clip': expected a finite float > 0"):
        method(args["x"], args["weights"], factor=0.5, clip=-1.0)
    with pytest.raises(ArgumentError, match="'out'"):
        method(args["x"], args["weights"], factor=0.5, out=np.zeros((5, 6), np.float32))


def test_an_implementation_coverage_and_bucket(toy: ScaleRows, rng: np.random.Generator) -> None:
    """A backend registers an implementation and declares its coverage by the op's features."""
    from halfakes import HostBackend

    backend = HostBackend()

    def register(registry: Any) -> None:
        registry.register(OpImpl(toy.name, _kernel, name="host.toy"))
        registry.declare(toy.name, OpCoverage(dtypes={"fp32"}))

    backend.register_ops = register  # type: ignore[method-assign]
    ops = Ops.attach(backend)
    args = _inputs(rng, {"rows": 3, "cols": 4, "dtype": "fp32"})
    assert_close(ops.toy_scale_rows(args["x"], args["weights"], factor=0.5), toy.reference(args),
                 kind="gemm", dtype="fp32")
    assert ops.stats()[toy.name]["implementations"] == {"host.toy": 1}
    call = ops.prepare(toy.name, **args)
    assert ops.coverage(toy.name).covers_call(toy, call.args) is True
    half = ops.prepare(toy.name, **_inputs(rng, {"rows": 3, "cols": 4, "dtype": "fp16"}))
    assert "dtype 'fp16' is not declared" in str(ops.coverage(toy.name).covers_call(toy, half.args))
    assert toy.bucket(call.args) == "r4"
    with pytest.raises(ValueError, match="unknown feature"):
        ops.registry.declare(toy.name, OpCoverage(head_sizes={64}))


def test_explain_and_bench(toy: ScaleRows) -> None:
    """hal info --explain shows the op's declared case; hal bench runs its preset against the limits."""
    backend = hal_core.get_backend("cpu")
    rows = [row for row in explain(backend) if row["op"] == toy.name]
    assert len(rows) == 1 and rows[0]["candidates"][-1] == {"implementation": "fallback",
                                                            "verdict": "runs on the float64 reference"}
    assert parse_shape(f"{toy.name}:rows=3")[1] == {"rows": 3, "cols": 8, "dtype": "fp32"}
    cases = bench.preset_cases("toy")
    assert [c.label for c in cases] == ["toy_scale_rows fp32 16x32", "toy_scale_rows fp16 8x8"]
    assert "toy" in bench.preset_names()
    settings = bench.BenchSettings(policy=bench.TimingPolicy(repeat=3, warmup=1, max_seconds=0.05), quick=True,
                                   copy_bytes=1 << 20, blas_n=64)
    report = bench.run_bench(cases, backend, settings)
    for case in report["cases"]:
        assert case["hal"]["median_ms"] > 0 and case["flops"] == 2 * case["params"]["rows"] * case["params"]["cols"]


def test_torch_operator_and_fake(toy: ScaleRows, rng: np.random.Generator) -> None:
    """torch.ops.hal gains the op and its _out variant, with a fake that traces under torch.compile."""
    torch = pytest.importorskip("torch")
    from hal_core.torch._ops import register_torch_ops, wrapper

    register_torch_ops(toy)
    args = _inputs(rng, {"rows": 6, "cols": 5, "dtype": "fp32"})
    x, w = torch.from_numpy(args["x"]), torch.from_numpy(args["weights"])
    expected = toy.reference(args)
    got = torch.ops.hal.toy_scale_rows(x, w, 0.5)
    assert_close(got.numpy(), expected, kind="gemm", dtype="fp32")
    fn = wrapper(toy)
    out = torch.empty_like(x)
    assert fn(x, w, 0.5, out=out) is out
    assert_close(out.numpy(), expected, kind="gemm", dtype="fp32")
    torch.library.opcheck(torch.ops.hal.toy_scale_rows.default, (x, w, 0.5))
    torch.library.opcheck(torch.ops.hal.toy_scale_rows_out.default, (x, w, 0.5, torch.empty_like(x), 0.2))
    compiled = torch.compile(lambda a, b: fn(a, b, 0.5, clip=0.2) * 2, backend="eager", fullgraph=True)
    assert_close(compiled(x, w).numpy(), 2 * np.clip(expected, -0.2, 0.2), kind="gemm", dtype="fp32")
    with pytest.raises(Exception, match="argument 'weights'"):  # the fake's check, as a trace sees it
        torch.compile(lambda a, b: fn(a, b, 0.5), backend="eager", fullgraph=True)(x, w[:2])
