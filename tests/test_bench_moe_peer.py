"""hal bench's fused_moe peer: transformers' eager Qwen3-MoE experts on the dequantised experts.

The peer must compute what hal's op computes on int4 experts (W4A16, within the dtype's rounding), agree with the
float64 reference, and apply to fused_moe cases on host backends only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core import bench
from hal_core.ops import OPS
from hal_core.ops.fused_moe import fused_moe_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SEED = 20261205
#: (rtol, atol) of the peer against the float64 reference: bf16 eager experts round after each op.
TOL = {"fp32": (1e-4, 1e-4), "bf16": (5e-2, 5e-2)}


def _peer() -> bench.Peer:
    (peer,) = bench.peers_for(bench.make_case("fused_moe"), host=True)
    return peer


@pytest.mark.parametrize("routing", ["softmax_topk", "softmax_topk_renorm", "topk_softmax"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_moe_peer_matches_hal_and_the_reference(cpu: Any, dtype: str, routing: str) -> None:
    """The eager Qwen3-MoE experts on dequantised int4 experts equal hal's fused_moe and the float64 reference."""
    seed = SEED + len(routing) + len(dtype)
    print(f"seed {seed}")
    args = fused_moe_inputs(np.random.default_rng(seed), num_tokens=7, num_experts=8, top_k=2, hidden=64,
                            intermediate=32, bits=4, group_size=32, dtype=dtype, logits_dtype="fp32", routing=routing)
    out = _peer().build([args], np)(0)
    got = out.to(torch.float64).numpy()
    expected = OPS["fused_moe"].reference(args)
    hal = np.asarray(cpu.ops.fused_moe(args["hidden_states"], args["router_logits"], args["experts"], top_k=2,
                                       routing=routing), dtype=np.float64)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got, hal, rtol=rtol, atol=atol)


def test_fused_moe_peer_applies_to_host_fused_moe_cases_only() -> None:
    """Every fused_moe preset case has this one peer on a host backend and none on a device backend."""
    cases = [case for preset in ("decode", "prefill") for case in bench.preset_cases(preset) if case.op == "fused_moe"]
    assert cases
    for case in cases:
        assert [p.name for p in bench.peers_for(case, host=True)] == ["torch eager Qwen3-MoE experts (dequantised)"]
        assert bench.peers_for(case, host=False) == []
