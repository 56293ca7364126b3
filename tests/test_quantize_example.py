"""examples/quantize_generate.py quantizes a random Llama to int4 through hal and generates with it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quantize_generate.py"


def test_example_quantizes_generates_and_reports() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--layers", "2", "--hidden", "128", "--new-tokens", "5",
                           "--group-size", "64", "--torch-threads", "1"], capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert "quantized 14 linear layers to int4 (group size 64); left in float: lm_head" in proc.stdout
    float_mb, int4_mb = map(float, re.search(r"linear weights: ([\d.]+) MB float -> ([\d.]+) MB int4",
                                             proc.stdout).groups())
    assert 6 < float_mb / int4_mb < 8  # 4 bits a weight plus an fp16 scale per 64
    assert re.search(r"tokens/s \(generate, hal attention\): float [\d.]+, int4 [\d.]+", proc.stdout)
    int4_rows = re.findall(r"^         int4  \[([\d, ]+)\]$", proc.stdout, re.M)
    assert len(int4_rows) == 2 and all(len(row.split(",")) == 5 for row in int4_rows)
    assert re.search(r"int4 greedy tokens matching float: \d+/10 \(leading run per row: \[\d+, \d+\]\)", proc.stdout)
    assert "14/14" in proc.stderr  # the progress bar, one step per layer
