"""The peer of ``fused_moe``: transformers' eager Qwen3-MoE experts on the same experts, dequantized.

From the case's router logits the peer runs what ``Qwen3MoeSparseMoeBlock`` runs after its router's linear:
``softmax`` in float32, ``torch.topk``, the top weights renormalised for the renormalising routings (what
``norm_topk_prob`` does; ``topk_softmax`` gives the same weights) and cast to the hidden dtype, then
``Qwen3MoeExperts.forward`` (eager: per hit expert ``F.linear`` on ``gate_up_proj[e]``, ``chunk(2)``,
``act(gate) * up``, ``F.linear`` on ``down_proj[e]``, the weighted ``index_add_``). Its ``gate_up_proj [E, 2I, H]``
and ``down_proj [E, H, I]`` are hal's experts dequantized beforehand to the hidden dtype (bf16 in the presets):
what a transformers user without quantized experts runs. It keeps the activations in float for int8 cases too
(no W8A8). It needs torch and transformers (``missing`` without them) and runs on host backends, under
``torch.inference_mode()`` with torch's threads set as for the step peers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..quant import ExpertWeights
from ._peer_base import Peer, PeerUnavailable, Runner, inference, rotating, to_torch
from ._step_peers import _step_torch

__all__ = ["MOE_PEERS", "qwen3_moe_experts"]

#: hal's activation -> the ``hidden_act`` transformers names it by.
_HIDDEN_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def qwen3_moe_experts(torch: Any, experts: ExpertWeights, activation: str, dtype: Any) -> Any:
    """transformers' ``Qwen3MoeExperts`` (eager) holding ``experts`` dequantized to ``dtype``."""
    try:
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not installed ({exc}); pip install transformers") from None
    e, hidden, inter = experts.shape
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=e,
                                         hidden_act=_HIDDEN_ACT[activation])
    config._experts_implementation = "eager"  # transformers' own loop, whatever its default
    with torch.device("meta"):  # no float storage of its own: the parameters are replaced next
        module = Qwen3MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj = torch.nn.Parameter(torch.stack([
            torch.from_numpy(w.dequantize(np.float32).T.copy()) for w in experts.w13]).to(dtype), requires_grad=False)
        module.down_proj = torch.nn.Parameter(torch.stack([
            torch.from_numpy(w.dequantize(np.float32).T.copy()) for w in experts.w2]).to(dtype), requires_grad=False)
    return module


def _block(torch: Any, module: Any, x: Any, logits: Any, top_k: int, renorm: bool) -> Any:
    """The block's steps after the router's linear: routing weights from ``logits``, then the experts."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    return module(x, ids, top.to(x.dtype))


def _fused_moe(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = _step_torch()
    calls: list[Callable[[], object]] = []
    for args in inputs:
        x, logits = to_torch(torch, args["hidden_states"]), to_torch(torch, args["router_logits"])
        module = qwen3_moe_experts(torch, args["experts"], args.get("activation") or "silu", x.dtype)
        renorm = (args.get("routing") or "softmax_topk") != "softmax_topk"
        top_k = int(args["top_k"])
        calls.append(inference(torch, functools.partial(_block, torch, module, x, logits, top_k, renorm)))
    calls[0]()  # fails here, not while timing, when this torch cannot run it
    return rotating(calls)


#: fused_moe's peer (added to ``PEERS``).
MOE_PEERS: tuple[Peer, ...] = (
    Peer("torch eager Qwen3-MoE experts (dequantised)", lambda case, host: host and case.op == "fused_moe",
         _fused_moe),
)
