"""hal bench's interference rows: an op timed alone and right after a small torch op, and how they reach the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hal_core import bench
from hal_core.bench import _interference, _runner
from hal_core.ops import OPS

#: A small W4A16 GEMV, so the test runs in moments (the bench itself times the op's default case).
SMALL = {"quantized_gemm": {"m": 1, "k": 256, "n": 512, "bits": 4, "group": 64, "dtype": "fp32"}}


def _check_row(row: dict[str, Any], calls: int) -> None:
    assert set(row) == {"op", "implementation", "case", "torch_op", "calls", "alone_ms", "alternating_ms", "ratio"}
    assert row["op"] in _interference.INTERFERENCE_OPS and isinstance(row["implementation"], str)
    assert row["case"] == {**OPS[row["op"]].bench.params, **SMALL[row["op"]]}
    assert row["torch_op"] == "mm 64x256 x 256x256" and row["calls"] == calls
    assert row["alone_ms"] > 0 and row["alternating_ms"] > 0
    assert row["ratio"] == pytest.approx(row["alternating_ms"] / row["alone_ms"], rel=1e-12)


def test_rows_time_each_op_alone_and_after_torch(cpu) -> None:
    """One row per op with both medians (wall ms, positive) and their ratio; rounds x calls calls each way."""
    pytest.importorskip("torch")
    rows = _interference.measure_interference(cpu, rounds=2, calls=3, cases=SMALL)
    assert [row["op"] for row in rows] == list(_interference.INTERFERENCE_OPS)
    for row in rows:
        _check_row(row, calls=6)
    table = _interference.format_interference(rows)
    assert "beside torch" in table and "quantized_gemm" in table and f"{rows[0]['ratio']:.2f}" in table


def test_without_torch_each_row_says_so(cpu, monkeypatch) -> None:
    """Where torch is not installed the rows carry a note instead of figures, and the table shows it."""
    real = _interference.importlib.util.find_spec
    monkeypatch.setattr(_interference.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    rows = _interference.measure_interference(cpu, cases=SMALL)
    assert rows == [{"op": op, "note": "torch is not installed"} for op in _interference.INTERFERENCE_OPS]
    assert "torch is not installed" in _interference.format_interference(rows)


def test_the_rows_reach_the_json_and_the_table(cpu, monkeypatch, tmp_path: Path) -> None:
    """With the overhead rows on (not --quick), run_bench's report holds the interference rows, as does the table."""
    pytest.importorskip("torch")
    monkeypatch.setattr(_runner, "measure_overhead", lambda backend: [])
    monkeypatch.setattr(_runner, "measure_interference",
                        lambda backend: _interference.measure_interference(backend, rounds=1, calls=2, cases=SMALL))
    settings = bench.BenchSettings(policy=bench.TimingPolicy(repeat=3, warmup=1, max_seconds=0.05), peers=(),
                                   copy_bytes=1 << 20, blas_n=64, overhead=True)
    report = bench.run_bench([bench.parse_shape("write_kv_cache", "tokens=4,kv_heads=2,head=16,block=4")], cpu,
                             settings)
    for row in report["interference"]:
        _check_row(row, calls=2)
    saved = json.loads(Path(bench.write_report(report, tmp_path / "bench.json")).read_text())
    assert saved["interference"] == report["interference"]
    assert "beside torch (wall, median)" in bench.format_table(report)
    off = bench.run_bench([bench.parse_shape("write_kv_cache", "tokens=4,kv_heads=2,head=16,block=4")], cpu,
                          bench.BenchSettings(policy=settings.policy, peers=(), copy_bytes=1 << 20, blas_n=64))
    assert off["interference"] is None


def test_the_default_case_is_the_decode_gemv() -> None:
    """Without overrides the timed op runs its default bench case: W4A16 M=1, 4096x11008 (the figure docs quote)."""
    params = OPS["quantized_gemm"].bench.params
    assert (params["m"], params["k"], params["n"], params["bits"]) == (1, 4096, 11008, 4)
