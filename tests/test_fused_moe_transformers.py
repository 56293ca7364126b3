"""fused_moe against transformers' eager MoE blocks (Qwen3-MoE, Mixtral) holding the same dequantised experts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core.quant import ExpertWeights, quantize_experts
from hal_core.testing.inputs import assert_close

torch = pytest.importorskip("torch")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
transformers = pytest.importorskip("transformers")

HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 128, 64, 8, 2, 64


def _block(model: str, norm_topk_prob: bool) -> Any:
    """A float64 eager MoE block of ``model`` with random router and expert weights."""
    common = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K, "hidden_act": "silu"}
    if model == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                             norm_topk_prob=norm_topk_prob)
        block = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=INTER, num_local_experts=EXPERTS)
        block = mixtral.MixtralSparseMoeBlock(config)
    block = block.double().eval()
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0 / HIDDEN ** 0.5)
        block.experts.gate_up_proj.normal_(0.0, 1.0 / HIDDEN ** 0.5)
        block.experts.down_proj.normal_(0.0, 1.0 / INTER ** 0.5)
    return block


def _quantize_block(block: Any, bits: int) -> ExpertWeights:
    """The block's experts quantised by quantize_experts; the block is given their dequantised values back."""
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2 * inter, hidden], gate rows first
    down = block.experts.down_proj.detach().numpy()  # [E, hidden, inter]
    experts = quantize_experts(gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1), bits=bits, group_size=GROUP)
    with torch.no_grad():
        for e in range(EXPERTS):
            block.experts.gate_up_proj[e] = torch.from_numpy(experts.w13[e].dequantize().T.copy())
            block.experts.down_proj[e] = torch.from_numpy(experts.w2[e].dequantize().T.copy())
    return experts


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("model", "norm_topk_prob", "routing"), [
    ("qwen3_moe", False, "softmax_topk"),
    ("qwen3_moe", True, "softmax_topk_renorm"),
    ("mixtral", True, "softmax_topk_renorm"),
    ("mixtral", True, "topk_softmax"),
])
def test_fused_moe_matches_transformers_block(hal_rng: np.random.Generator, model: str, norm_topk_prob: bool,
                                              routing: str, dtype: str) -> None:
    """hal-cpu's fused_moe (int4 experts) matches the float64 eager block holding the dequantised experts."""
    torch.manual_seed(int(hal_rng.integers(2**31)))
    block = _block(model, norm_topk_prob)
    experts = _quantize_block(block, bits=4)
    x = hal_rng.uniform(-1.0, 1.0, (19, HIDDEN)).astype(np.float32)
    if dtype == "bf16":
        x = x.astype(hal_core.arrays.numpy_dtype("bf16"))
    x64 = torch.from_numpy(x.astype(np.float64))
    logits = (x64 @ block.gate.weight.detach().T).numpy().astype(np.float32)
    with torch.no_grad():
        expected = block(x64[None]).reshape(19, HIDDEN).numpy()
    backend = hal_core.get_backend("cpu")
    got = backend.ops.fused_moe(x, logits, experts, top_k=TOP_K, routing=routing)
    assert_close(got, expected, kind="gemm", dtype=dtype, what=f"fused_moe vs {model}")


def test_fused_moe_int8_experts_match_transformers_block(hal_rng: np.random.Generator) -> None:
    """int8 experts (W8A8: both GEMMs' inputs quantised per token, each element off by up to amax / 254) match
    the float block's rows within 3% (L2); a wrongly routed or weighted expert is off by tens of percent."""
    torch.manual_seed(int(hal_rng.integers(2**31)))
    block = _block("qwen3_moe", True)
    experts = _quantize_block(block, bits=8)
    x = hal_rng.uniform(-1.0, 1.0, (7, HIDDEN)).astype(np.float32)
    x64 = torch.from_numpy(x.astype(np.float64))
    logits = (x64 @ block.gate.weight.detach().T).numpy().astype(np.float32)
    with torch.no_grad():
        expected = block(x64[None]).reshape(7, HIDDEN).numpy()
    got = hal_core.get_backend("cpu").ops.fused_moe(x, logits, experts, top_k=TOP_K, routing="softmax_topk_renorm")
    error = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert error.max() <= 0.03, error


def test_fused_moe_has_no_torch_operator_and_the_others_keep_theirs() -> None:
    """Registering fused_moe (a weight torch schemas cannot hold) leaves every other torch.ops.hal operator."""
    from hal_core.ops import OPS
    from hal_core.torch import _ops  # noqa: F401  (defines torch.ops.hal)
    from hal_core.torch._schema import torch_ops

    assert torch_ops(OPS["fused_moe"]) == []
    assert not hasattr(torch.ops.hal, "fused_moe")
    for name in OPS:
        if name != "fused_moe":
            assert hasattr(torch.ops.hal, name), name
