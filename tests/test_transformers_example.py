"""examples/transformers_generate.py runs a random Llama through hal and reproduces eager's tokens."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_generate.py"


def test_example_generates_eager_tokens_through_hal() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--layers", "2", "--new-tokens", "6", "--block-size", "8",
                           "--seed", "4"], capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert "hal's greedy tokens match eager's" in proc.stdout
    assert len(re.findall(r"^  prompt \d \(\d+ tokens\): same$", proc.stdout, re.M)) == 3
    hal_rows = re.findall(r"^    hal:   \[([\d, ]+)\]$", proc.stdout, re.M)
    assert len(hal_rows) == 3 and all(len(row.split(",")) == 6 for row in hal_rows)
    # 12 + 7 + 3 prompt tokens, then 5 fed-back tokens for each of the three rows
    assert "hal cache: 37 tokens" in proc.stdout


def test_example_times_a_prefill_against_sdpa_with_the_same_logits() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--prefill", "96", "--layers", "1", "--repeat", "1",
                           "--block-size", "32"], capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert re.search(r"^  sdpa  prefill +[\d.]+ ms", proc.stdout, re.M)
    assert re.search(r"^  hal   prefill +[\d.]+ ms", proc.stdout, re.M)
    assert re.search(r"hal is [\d.]+x sdpa's prefill speed; largest logit difference", proc.stdout)


def test_example_refuses_a_bad_prefill_length() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--prefill", "0"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "--prefill" in proc.stderr
