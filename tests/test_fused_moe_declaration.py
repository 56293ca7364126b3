"""fused_moe's declaration: bench presets, byte and flop counts, the expert weights' arrays moving together."""

from __future__ import annotations

from typing import Any

import numpy as np

from hal_core import bench
from hal_core.bench import _inputs
from hal_core.ops import OPS
from hal_core.ops.fused_moe import expected_experts, fused_moe_inputs
from hal_core.quant import ExpertWeights

SPEC = OPS["fused_moe"]


def test_presets_are_qwen3_moe_at_1_8_and_512_tokens() -> None:
    """decode runs 1 and 8 tokens, prefill 512, all on 64 experts (top 8), hidden 2048, intermediate 768."""
    presets = SPEC.bench.presets
    decode, prefill = presets["decode"](), presets["prefill"]()
    assert sorted({p["tokens"] for p in decode}) == [1, 8] and {p["tokens"] for p in prefill} == {512}
    for p in [*decode, *prefill]:
        assert (p["experts"], p["top_k"], p["hidden"], p["inter"]) == (64, 8, 2048, 768)
        assert SPEC.bench.check(p) is None
    assert {p["bits"] for p in decode} == {4, 8}


def test_bench_inputs_validate_and_count_the_routed_experts_bytes() -> None:
    """A bench case's inputs pass validation; nbytes is the expected routed experts' bytes plus activations."""
    rng = np.random.default_rng(5)
    for tokens in (1, 8, 512):
        case = bench.make_case("fused_moe", tokens=tokens, experts=16, top_k=4, hidden=256, inter=128, group=64)
        args = _inputs.build_inputs(case, rng)
        SPEC.validate(dict(args), np.asarray)
        experts: ExpertWeights = args["experts"]
        one_expert = experts.nbytes // 16
        routed = {1: 4, 8: round(16 * (1 - (12 / 16) ** 8)), 512: 16}[tokens]
        activations = 2 * tokens * 256 * 2 + tokens * 16 * 4  # bf16 in and out, fp32 logits
        assert SPEC.nbytes(args) == routed * one_expert + activations
        assert SPEC.flops(args) == tokens * 4 * 6 * 256 * 128
        assert SPEC.bucket(args) == f"w4:t{1 if tokens == 1 else tokens}"


def test_expected_experts_bounds() -> None:
    """One token reaches exactly top_k experts, none reach none, and many reach all of them."""
    assert expected_experts(1, 64, 8) == 8
    assert expected_experts(0, 64, 8) == 0
    assert round(expected_experts(512, 64, 8)) == 64


def test_every_expert_array_moves_with_the_weight() -> None:
    """map_arrays (the device round trip of a fallback) moves each array of each expert, and nothing else."""
    args = fused_moe_inputs(np.random.default_rng(1), num_tokens=2, num_experts=3, top_k=2, hidden=64,
                            intermediate=32, bits=8, group_size=32, dtype="fp32", symmetric=False)
    moved: list[Any] = []

    def mark(array: np.ndarray) -> np.ndarray:
        moved.append(array)
        return array.copy()

    copied = SPEC.map_arrays(args, mark)
    expert_arrays = 3 * 2 * 3  # experts x (w13, w2) x (qweight, scales, zeros)
    assert len(moved) == 2 + expert_arrays
    assert isinstance(copied["experts"], ExpertWeights)
    assert len(copied["experts"].arrays()) == expert_arrays
    for name, array in copied["experts"].arrays().items():
        assert array is not args["experts"].arrays()[name]
        np.testing.assert_array_equal(array, args["experts"].arrays()[name])
    np.testing.assert_array_equal(SPEC.reference(copied), SPEC.reference(args))
