"""fused_moe's pure launch rules and plan, and the reasons its GPU ``check`` gives for calls it leaves to the host.

No device and no compiler: the worst-case tile count, the grids, the buffers and launch order of the plan (W4A16
and W8A8), and the refusals (group size, sizes not multiples of the group, non-fp16 scales, act-order experts,
non-contiguous inputs), each naming what is wrong.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hal_cupy.ops import _fused_moe
from hal_cupy.ops._fused_moe_plan import MoeShape, buffers, steps
from hal_cupy.ops._fused_moe_rules import MOE_TILE, gemm_launch, max_tiles, moe_spec

from hal_core.ops import OPS, OpCall
from hal_core.quant import ExpertWeights
from hal_core.testing.inputs import fused_moe_inputs


def _call(args: dict[str, Any]) -> OpCall:
    return OpCall(spec=OPS["fused_moe"], args=args, backend=None, host_arrays=True)  # type: ignore[arg-type]


def _args(rng: np.random.Generator, **overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"num_tokens": 5, "num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 32,
                              "bits": 4, "group_size": 32, "dtype": "fp16"}
    return fused_moe_inputs(rng, **{**params, **overrides})


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 1, 1), (1, 8, 64), (512, 8, 64), (3, 2, 128)])
def test_worst_case_tiles_hold_every_padded_assignment(tokens: int, top_k: int, experts: int) -> None:
    """max_tiles covers the worst padding: each expert's count rounded up to a whole tile, for random loads too."""
    rng = np.random.default_rng(tokens * 1000 + experts)
    worst = max_tiles(tokens, top_k, experts)
    assert worst == -(-(tokens * top_k + experts * (MOE_TILE - 1)) // MOE_TILE)
    for _ in range(50):
        counts = np.bincount(rng.integers(0, experts, tokens * top_k), minlength=experts)
        assert (-(-counts // MOE_TILE)).sum() <= worst


def test_gemm_grid_covers_every_column() -> None:
    """Grid x: the tiles; grid y: blocks of 4 columns per lane; block: 4 warps."""
    assert gemm_launch("hal_moe_w4_down", 7, 160, 32).grid == (7, 2, 1)
    assert gemm_launch("hal_moe_w4_down", 7, 256, 64).grid == (7, 1, 1)
    assert gemm_launch("hal_moe_w8_gate_up", 3, 257, 32).block == (128, 1, 1)


@pytest.mark.parametrize(("bits", "int8", "name"), [(4, False, "w4"), (4, True, "w4a8"), (8, False, "w8"),
                                                    (8, True, "w8")])
def test_plan_order_and_buffers(bits: int, int8: bool, name: str) -> None:
    """Route, align, scatter, (int8 activations: quantise x), gate/up, (quantise the intermediate), down, combine;
    only the per-expert counts start zeroed; int8 experts quantise whatever the setting says."""
    shape = MoeShape(5, 4, 2, 64, 32, 32, bits, int8_activations=int8)
    kernels = [s.launch.kernel for s in steps(shape, 32)]
    quantise = ["hal_w8a8_quantize_rows"] if name != "w4" else []
    assert kernels == ["hal_moe_route", "hal_moe_align", "hal_moe_scatter", *quantise, f"hal_moe_{name}_gate_up",
                       *quantise, f"hal_moe_{name}_down", "hal_moe_combine"]
    found = buffers(shape)
    assert [n for n, b in found.items() if b.zeroed] == ["counts"]
    assert found["sorted_pairs"].shape == (shape.tiles * MOE_TILE,)
    assert found["y"].shape == (10, 64)
    assert ("xq" in found) == (name != "w4")
    spec = moe_spec("float32", bits, 32, int8)
    assert ("HAL_ABITS", "8") in spec.defines if name == "w4a8" else all(d[0] != "HAL_ABITS" for d in spec.defines)
    assert f"hal_moe_{name}_gate_up" in spec.kernels


def test_supported_call_passes(rng: np.random.Generator) -> None:
    """int4 and int8 experts of a served group size: no reason."""
    for bits in (4, 8):
        assert _fused_moe.check(_call(_args(rng, bits=bits))) == ""


def test_refusals_name_the_reason(rng: np.random.Generator) -> None:
    """Each unsupported call gets a reason naming the setting or the argument."""
    assert "group_size 16" in _fused_moe.check(_call(_args(rng, group_size=16)))
    experts = _args(rng)["experts"]
    f32 = _args(rng)
    f32["experts"] = ExpertWeights(experts.w13, (*experts.w2[:3], replace(experts.w2[3],
                                                                          scales=experts.w2[3].scales.astype(np.float32))))
    assert "experts.w2[3]: scales are fp32" in _fused_moe.check(_call(f32))
    act_order = _args(rng)
    g_idx = (np.arange(64) // 32).astype(np.int32)[::-1].copy()
    act_order["experts"] = ExpertWeights((replace(experts.w13[0], g_idx=g_idx), *experts.w13[1:]), experts.w2)
    assert "experts.w13[0]: act-order" in _fused_moe.check(_call(act_order))
    strided = _args(rng)
    strided["hidden_states"] = np.asfortranarray(strided["hidden_states"])
    assert "'hidden_states' is not C-contiguous" in _fused_moe.check(_call(strided))
