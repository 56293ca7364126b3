"""fused_moe on a GPU against the float64 reference (skipped where no CUDA device is usable).

``HAL_STRICT=1``: a call that would fall back to the CPU path fails, so every case runs ``fused_moe.cu``.
Fresh random inputs (the seed is printed by the ``rng`` fixture): int4 experts with float (W4A16) and int8 (W4A8)
activations and int8 experts (W8A8), every dtype and routing,
top_k 1, 2 and 8, all tokens on one expert, a prompt-sized batch, the same bits on a second call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core.ops import OPS
from hal_core.ops.fused_moe import ROUTINGS
from hal_core.testing.inputs import assert_close, fused_moe_inputs

REFERENCE = OPS["fused_moe"].reference


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


def _run(be: Any, args: dict[str, Any]) -> np.ndarray:
    experts = args["experts"].map_arrays(be.asarray)
    extra = {k: args[k] for k in ("routing", "activation", "activations") if k in args}
    out = be.ops.fused_moe(be.asarray(args["hidden_states"]), be.asarray(args["router_logits"]), experts,
                           top_k=args["top_k"], **extra)
    return np.asarray(be.to_numpy(out))


def _format(args: dict[str, Any], fmt: str) -> dict[str, Any]:
    """``args`` with the format's activations; the tolerance kind its comparison takes (int8 activations: a
    re-quantised intermediate may flip a code at a rounding tie)."""
    if fmt == "w4a8":
        args["activations"] = "int8"
    return args


def _kind(fmt: str) -> str:
    return "gemm" if fmt == "w4a16" else "moe_w8a8"


#: The experts' formats: int4 with float activations, int4 with int8 activations, int8.
FORMATS = ("w4a16", "w4a8", "w8a8")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_moe(be: Any, rng: np.random.Generator, fmt: str, dtype: str, routing: str) -> None:
    """Qwen3-MoE-like routing (64 experts, top 8) over 24 tokens: the reference's output."""
    bits = 8 if fmt == "w8a8" else 4
    args = _format(fused_moe_inputs(rng, num_tokens=24, num_experts=64, top_k=8, hidden=512, intermediate=256,
                                    bits=bits, group_size=128, dtype=dtype, routing=routing, symmetric=bits == 8), fmt)
    assert_close(_run(be, args), REFERENCE(args), kind=_kind(fmt), dtype=dtype, what="fused_moe")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (3, 2), (300, 2)])
def test_fused_moe_sizes(be: Any, rng: np.random.Generator, fmt: str, tokens: int, top_k: int) -> None:
    """Decode and a prompt-sized batch, odd hidden and intermediate sizes (multiples of the group), gelu."""
    args = _format(fused_moe_inputs(rng, num_tokens=tokens, num_experts=8, top_k=top_k, hidden=160, intermediate=96,
                                    bits=8 if fmt == "w8a8" else 4, group_size=32, dtype="bf16", activation="gelu"),
                   fmt)
    assert_close(_run(be, args), REFERENCE(args), kind=_kind(fmt), dtype="bf16", what="fused_moe")


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_one_expert_takes_every_token(be: Any, rng: np.random.Generator, bits: int) -> None:
    """Every token's first expert is expert 5 (many row tiles), the others see a few tokens or none; a second call
    gives the same bits."""
    args = fused_moe_inputs(rng, num_tokens=100, num_experts=16, top_k=2, hidden=256, intermediate=128, bits=bits,
                            group_size=64, dtype="fp16")
    args["router_logits"][:, 5] = 50.0
    first = _run(be, args)
    assert_close(first, REFERENCE(args), kind="gemm", dtype="fp16", what="fused_moe")
    np.testing.assert_array_equal(_run(be, args).view(np.uint16), first.view(np.uint16))
