"""``sample`` in hal bench and hal info --explain: the documented presets, valid inputs, explained cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hal_core
from hal_core import bench
from hal_core.cli import main
from hal_core.ops import OPS


def test_decode_preset_holds_the_sampling_cases() -> None:
    """decode: 1 and 8 sequences at vocabularies 32000 and 128256, fp32, sampling and greedy."""
    decode = bench.preset_cases("decode", ["sample"])
    expected = {bench.make_case("sample", seqs=s, vocab=v, greedy=g, dtype="fp32")
                for s in (1, 8) for v in (32000, 128256) for g in (0, 1)}
    assert set(decode) == expected


def test_bench_inputs_are_valid_calls() -> None:
    """Each preset case's inputs pass the op's checks and run on the CPU backend (tokens in range)."""
    cpu = hal_core.get_backend("cpu")
    rng = np.random.default_rng(11)
    for case in bench.preset_cases("decode", ["sample"])[:4]:
        cases = OPS["sample"].bench
        assert cases is not None
        args = cases.inputs(rng, dict(case.params))
        tokens = cpu.ops.sample(**args)
        assert tokens.shape == (case.params["seqs"],)
        assert ((tokens >= 0) & (tokens < case.params["vocab"])).all()
        if case.params["greedy"]:
            np.testing.assert_array_equal(tokens, np.argmax(args["logits"], axis=1))


def test_shape_syntax_accepts_sample_and_rejects_a_bad_greedy() -> None:
    """``sample:seqs=4,vocab=151936,dtype=bf16`` parses; ``greedy=2`` is refused naming the flag."""
    case = bench.parse_shape("sample", "seqs=4,vocab=151936,dtype=bf16")
    assert case.params["vocab"] == 151936 and case.params["greedy"] == 0
    with pytest.raises(bench.BenchArgumentError, match="greedy"):
        bench.parse_shape("sample", "greedy=2")


def test_info_explains_sample(capsys: pytest.CaptureFixture[str]) -> None:
    """``hal info --explain --shape sample:...`` names the CPU kernel as the one that runs."""
    assert main(["info", "--json", "--backend", "cpu", "--shape", "sample:seqs=2,vocab=100"]) == 0
    (case,) = json.loads(capsys.readouterr().out)["explain"]["cases"]
    assert case["op"] == "sample" and "error" not in case
    assert {c["implementation"]: c["verdict"] for c in case["candidates"]}["cpu.sample"] == "runs"
