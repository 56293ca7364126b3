"""examples/quantize_generate.py quantizes a random Llama through hal, measures its logits against float, generates."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quantize_generate.py"
ARGS = ["--layers", "2", "--hidden", "128", "--new-tokens", "5", "--group-size", "64", "--torch-threads", "1"]


def _run(*extra: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *ARGS, *extra], capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0
    return proc.stdout + proc.stderr


def _quantized_bytes(k: int, n: int, bits: int, group: int = 64) -> int:
    return k * n * bits // 8 + (k // group) * n * 2  # codes, and an fp16 scale per group and column


def _summary(out: str) -> tuple[float, float, float]:
    kl, top1, top5 = re.search(r"^  all +([\d.]+) +(\d+)% +(\d+)%", out, re.M).groups()
    return float(kl), float(top1), float(top5)


@pytest.fixture(scope="module")
def default_run() -> str:
    """The example's output with its defaults (int4 layers, int8 lm_head) on the small model of ARGS."""
    return _run()


def test_example_reports_memory_logit_error_and_tokens(default_run: str) -> None:
    """Default run: int4 layers, int8 lm_head; exact byte counts, a KL/top-k row per position, greedy tokens."""
    out = default_run
    assert "quantized 15 linear layers to int4, lm_head int8 (group size 64); left in float: none" in out
    # hidden 128, 8 heads of 16 (4 for keys and values), MLP 256, 2 layers, vocabulary 512
    layer = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)]
    float_bytes = 4 * (2 * sum(k * n for k, n in layer) + 128 * 512)
    quantized = 2 * sum(_quantized_bytes(k, n, 4) for k, n in layer) + _quantized_bytes(128, 512, 8)
    assert f"linear weights: {float_bytes / 1e6:.2f} MB float -> {quantized / 1e6:.2f} MB quantized" in out
    assert re.search(r"whole model: +[\d.]+ MB float -> [\d.]+ MB quantized; process RSS \d+ MB", out)
    rows = re.findall(r"^ +(\d+) +([\d.]+) +(\d+)% +(\d+)%$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(5))
    assert all(0 <= float(kl) < 50 and 0 <= int(t1) <= 100 and 0 <= int(t5) <= 100 for _, kl, t1, t5 in rows)
    kl, _, _ = _summary(out)
    assert kl == pytest.approx(np.mean([float(r[1]) for r in rows]), abs=1e-4) and kl > 0
    assert len(re.findall(r"^         int4  \[([\d, ]+)\]$", out, re.M)) == 2
    assert re.search(r"int4 greedy tokens matching float: \d+/10 \(leading run per row: \[\d+, \d+\]", out)
    assert "15/15" in out  # the progress bar, one step per layer


def test_int8_layers_move_the_logits_less_than_int4(default_run: str) -> None:
    """Same random model and tokens: W8A8 layers (lm_head float) move the logits far less than the int4 run."""
    int4 = _summary(default_run)
    int8_out = _run("--bits", "8", "--lm-head-bits", "float")
    assert "quantized 14 linear layers to int8, lm_head float (group size 64); left in float: lm_head" in int8_out
    int8 = _summary(int8_out)
    print(f"int4: {int4}, int8: {int8}")
    assert int8[0] < int4[0] / 4 and int8[1] >= int4[1]


def test_logit_agreement_against_a_direct_float64_computation() -> None:
    """KL, top-1 and top-5 agreement of the example's helper, against numpy on random logits (seed 11)."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("quantize_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(11)
    p_logits, q_logits = rng.standard_normal((2, 3, 2, 40)) * 3
    got = module.logit_agreement(torch.tensor(p_logits), torch.tensor(q_logits.astype(np.float32)))
    for b in range(3):
        for t in range(2):
            p = np.exp(p_logits[b, t] - p_logits[b, t].max())
            p /= p.sum()
            q = np.exp(q_logits[b, t].astype(np.float32).astype(np.float64) - q_logits[b, t].max())
            q /= q.sum()
            assert float(got["kl"][b, t]) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-6)
            assert float(got["top1"][b, t]) == float(p.argmax() == q.argmax())
            shared = set(np.argsort(-p)[:5]) & set(np.argsort(-q)[:5])
            assert float(got["top5"][b, t]) == len(shared) / 5
    same = module.logit_agreement(torch.tensor(p_logits), torch.tensor(p_logits))
    assert float(same["kl"].abs().max()) < 1e-12 and bool((same["top1"] == 1).all() and (same["top5"] == 1).all())
