"""``hal info --explain`` and ``--stats``: which implementation would run, and what ran.

``--explain`` builds each op's arguments for a few representative shapes
(or the shapes given with ``--shape``), validates them on the selected
backend exactly as a call would, and lists every candidate implementation
with its verdict: the one that would run, and why each other was passed
over; plus what the backend declares it runs itself (its
:class:`~hal_core.ops.OpCoverage`). Nothing is launched.

A shape is ``OP:key=value,...``, e.g.
``paged_attention:dtype=bf16,head_size=64,block_size=32,seq_len=300`` or
``quantized_gemm:m=1,k=4096,n=4096,bits=4,group_size=128``. Keys not given
take the first representative case's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import hal_core
from hal_core.ops import call_features

__all__ = ["REPRESENTATIVE", "explain", "parse_shape", "stats_report"]

#: The cases ``--explain`` shows when no ``--shape`` is given.
REPRESENTATIVE: dict[str, list[dict[str, Any]]] = {
    "paged_attention": [
        {"dtype": "fp16", "head_size": 128, "block_size": 16, "seq_len": 512, "num_seqs": 4,
         "num_heads": 32, "num_kv_heads": 8},
        {"dtype": "bf16", "head_size": 64, "block_size": 32, "seq_len": 4096, "num_seqs": 1,
         "num_heads": 8, "num_kv_heads": 1},
        {"dtype": "fp32", "head_size": 256, "block_size": 8, "seq_len": 33, "num_seqs": 2,
         "num_heads": 4, "num_kv_heads": 4},
    ],
    "write_kv_cache": [
        {"dtype": "fp16", "head_size": 128, "block_size": 16, "num_tokens": 8, "num_kv_heads": 8},
        {"dtype": "bf16", "head_size": 64, "block_size": 32, "num_tokens": 1, "num_kv_heads": 1},
    ],
    "quantized_gemm": [
        {"dtype": "fp16", "m": 1, "k": 4096, "n": 4096, "bits": 4, "group_size": 128},
        {"dtype": "bf16", "m": 256, "k": 1024, "n": 1024, "bits": 4, "group_size": 64},
        {"dtype": "fp16", "m": 16, "k": 1024, "n": 1024, "bits": 8, "group_size": 128},
    ],
}


def parse_shape(text: str) -> tuple[str, dict[str, Any]]:
    """``'OP:key=value,...'`` as ``(op, case)``; raises ValueError naming what is wrong."""
    op, _, rest = text.partition(":")
    if op not in REPRESENTATIVE:
        raise ValueError(f"--shape {text!r}: unknown op {op!r}; known: {sorted(REPRESENTATIVE)}")
    case = dict(REPRESENTATIVE[op][0])
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in case:
            raise ValueError(f"--shape {text!r}: expected key=value with a key of {sorted(case)}, got {item!r}")
        if key == "dtype":
            case[key] = value
            continue
        try:
            case[key] = int(value)
        except ValueError:
            raise ValueError(f"--shape {text!r}: {key} must be an integer, got {value!r}") from None
    return op, case


def _host_args(op: str, case: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    from hal_core.testing.inputs import paged_attention_inputs, quantized_gemm_inputs, write_kv_cache_inputs

    if op == "paged_attention":
        args = paged_attention_inputs(rng, seq_lens=[case["seq_len"]] * case["num_seqs"], num_heads=case["num_heads"],
                                      num_kv_heads=case["num_kv_heads"], head_size=case["head_size"],
                                      block_size=case["block_size"], dtype=case["dtype"])
        return {**args, "out": None}
    if op == "write_kv_cache":
        blocks = -(-case["num_tokens"] // case["block_size"]) + 1
        args = write_kv_cache_inputs(rng, num_tokens=case["num_tokens"], num_blocks=blocks,
                                     num_kv_heads=case["num_kv_heads"], block_size=case["block_size"],
                                     head_size=case["head_size"], dtype=case["dtype"])
        return {k: args[k] for k in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
    args = quantized_gemm_inputs(rng, m=case["m"], k=case["k"], n=case["n"], bits=case["bits"],
                                 group_size=case["group_size"], symmetric=True, dtype=case["dtype"])
    return {"x": args["x"], "qweight": args["qweight"], "out": None}


def explain(backend: Any, cases: Sequence[tuple[str, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """For each case: the op, the case, each candidate's verdict and the backend's declaration."""
    from hal_core.testing.inputs import to_backend

    if cases is None:
        cases = [(op, case) for op, listed in REPRESENTATIVE.items() for case in listed]
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
        declared = backend.ops.coverage(op).covers(call_features(op, call.args))
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
