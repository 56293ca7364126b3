"""``hal info --explain`` and ``--stats``: which implementation would run, and what ran.

``--explain`` builds each op's arguments for the representative cases it
declares (:attr:`hal_core.ops.BenchCases.explain`, or the shapes given with
``--shape``), validates them on the selected backend exactly as a call would,
and lists every candidate implementation with its verdict: the one that would
run, and why each other was passed over; plus what the backend declares it
runs itself (its :class:`~hal_core.ops.OpCoverage`). Nothing is launched.

A shape is ``OP:key=value,...`` with the op's benchmark parameters (or their
aliases), e.g. ``paged_attention:dtype=bf16,head_size=64,block_size=32,seq_len=300``
or ``quantized_gemm:m=1,k=4096,n=4096,bits=4,group_size=128``. Keys not given
take the op's first representative case's values, then its defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import hal_core
from hal_core.ops import OPS, BenchCases

__all__ = ["explain", "parse_shape", "representative", "stats_report"]


def _declared(op: str) -> BenchCases:
    spec = OPS.get(op)
    if spec is None or spec.bench is None or spec.bench.test_inputs is None:
        raise ValueError(f"unknown op {op!r}; known: {sorted(representative())}")
    return spec.bench


def representative() -> dict[str, list[dict[str, Any]]]:
    """Per op: the cases ``--explain`` shows when no ``--shape`` is given (defaults filled in)."""
    return {op: [{**spec.bench.params, **case} for case in spec.bench.explain]
            for op, spec in OPS.items() if spec.bench is not None and spec.bench.test_inputs is not None}


def parse_shape(text: str) -> tuple[str, dict[str, Any]]:
    """``'OP:key=value,...'`` as ``(op, case)``; raises ValueError naming what is wrong."""
    op, _, rest = text.partition(":")
    try:
        bench = _declared(op)
    except ValueError:
        raise ValueError(f"--shape {text!r}: unknown op {op!r}; known: {sorted(representative())}") from None
    case = {**bench.params, **(bench.explain[0] if bench.explain else {})}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = bench.aliases.get(key.strip().lower(), key.strip().lower())
        if not sep or key not in case:
            raise ValueError(f"--shape {text!r}: expected key=value with a key of {sorted(case)}, got {item!r}")
        if key == "dtype":
            case[key] = value.strip()
            continue
        try:
            case[key] = int(value)
        except ValueError:
            raise ValueError(f"--shape {text!r}: {key} must be an integer, got {value!r}") from None
    problem = bench.check(case)
    if problem:
        raise ValueError(f"--shape {text!r}: {problem}")
    return op, case


def _host_args(op: str, case: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    test_inputs = _declared(op).test_inputs
    assert test_inputs is not None  # _declared checked it
    return test_inputs(rng, case)


def explain(backend: Any, cases: Sequence[tuple[str, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """For each case: the op, the case, each candidate's verdict and the backend's declaration."""
    from hal_core.testing.inputs import to_backend

    if cases is None:
        cases = [(op, case) for op, listed in representative().items() for case in listed]
    rng = np.random.default_rng(0)
    rows = []
    for op, case in cases:
        row: dict[str, Any] = {"op": op, "case": case}
        try:
            args = to_backend(backend, op, _host_args(op, case, rng))
            call = backend.ops.prepare(op, **args)
        except (hal_core.HalError, ValueError, TypeError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        row["candidates"] = [{"implementation": name, "verdict": verdict}
                             for name, verdict in backend.ops.explain(call)]
        declared = backend.ops.coverage(op).covers_call(call.spec, call.args)
        row["declared"] = "runs it itself" if declared is True else declared
        rows.append(row)
    return rows


def stats_report() -> dict[str, Any]:
    """:func:`hal_core.stats` of this process."""
    return hal_core.stats()


def print_explain(backend: Any, rows: list[dict[str, Any]]) -> None:
    print(f"\nexplain: backend {backend.name!r}"
          + (f" (fallback: {backend.ops.fallback.name!r})" if backend.ops.fallback is not None else ""))
    for row in rows:
        case = ", ".join(f"{k}={v}" for k, v in row["case"].items())
        print(f"  {row['op']} [{case}]")
        if "error" in row:
            print(f"      invalid: {row['error']}")
            continue
        for candidate in row["candidates"]:
            print(f"      {candidate['implementation']:<28} {candidate['verdict']}")
        print(f"      {'declared':<28} {row['declared']}")


def print_stats(report: dict[str, Any]) -> None:
    print("\nstats of this process:")
    if not report:
        print("  no op has run in this process (call hal_core.cli.main(['info', '--stats']) from one that did)")
    for backend, per_op in report.items():
        for op, figures in per_op.items():
            ran = ", ".join(f"{name} x{count}" for name, count in figures["implementations"].items())
            print(f"  {backend}.{op}: {figures['calls']} calls ({ran}); "
                  f"{sum(figures['fallbacks'].values())} fell back, {figures['fallback_seconds'] * 1e3:.1f} ms there")
            for reason, count in figures["fallbacks"].items():
                print(f"      x{count}: {reason}")
