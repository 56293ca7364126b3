"""examples/tiny_engine.py serves sequences through hal and matches its float64 numpy model."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hal_core

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_engine.py"
ERROR_LINE = re.compile(r"max abs error vs float64 numpy model: (\S+) \(tolerance (\S+) ")


def run(*args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    match = ERROR_LINE.search(proc.stdout)
    assert match, f"no error line in the output (exit {proc.returncode})"
    return proc, float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_tiny_engine_matches_the_float64_model(cpu, dtype: str) -> None:
    """A small model in each dtype generates for every sequence with logits within tolerance (exit 0)."""
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    proc, error, tolerance = run("--dtype", dtype, "--seed", str(seed), "--hidden", "128", "--steps", "6",
                                 "--block-size", "8")
    assert proc.returncode == 0
    assert error <= tolerance
    assert len(re.findall(r"^  \w: arrived", proc.stdout, re.M)) == 5
    assert "cache after: 0/" in proc.stdout  # every finished sequence gave its blocks back


def test_tiny_engine_defers_arrivals_when_the_cache_is_full(cpu) -> None:
    """With a tiny cache, late requests join when blocks free up, and the logits still match."""
    proc, error, tolerance = run("--num-blocks", "6", "--block-size", "8", "--hidden", "128")
    assert proc.returncode == 0 and error <= tolerance
    joined = dict(re.findall(r"^  (\w): arrived at step \d+, joined at (\d+)", proc.stdout, re.M))
    assert int(joined["d"]) > 3


def test_tiny_engine_runs_every_step_op_on_the_backend(cpu, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, each op of the example's step reaches the CPU backend's compiled implementation (no host math
    in between: every op is counted, none falls back), and the run passes its own checks."""
    spec = importlib.util.spec_from_file_location("tiny_engine", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tiny_engine", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    before = hal_core.stats().get("cpu", {})
    assert module.main(["--hidden", "128", "--steps", "3", "--block-size", "8", "--seed", "4"]) == 0
    after = hal_core.stats()["cpu"]
    for op in ("rms_norm", "quantized_gemm", "rotary_embedding", "write_kv_cache", "paged_attention",
               "gated_activation", "sample"):
        calls = after.get(op, {}).get("calls", 0) - before.get(op, {}).get("calls", 0)
        assert calls > 0, op
        assert set(after[op]["implementations"]) == {f"cpu.{op}"} and not after[op]["fallbacks"], after[op]
    assert "sampled tokens equal the argmax of their logits: OK" in capsys.readouterr().out


def test_tiny_engine_imports_only_hal_core_and_numpy() -> None:
    """The example depends on nothing but hal_core, numpy and the standard library."""
    tree = ast.parse(EXAMPLE.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots - set(sys.stdlib_module_names) == {"hal_core", "numpy"}
