"""``fused_moe`` on the host: routing in numpy, then per expert one quantized GEMM, one gated activation, one GEMM.

1. Routing in float32: each token's ``top_k`` largest logits (a stable sort, so ties go to the lowest
   expert index) and their weights as ``routing`` says (:mod:`hal_core.ops.fused_moe`).
2. The ``num_tokens * top_k`` (token, expert) pairs are grouped by expert with a counting sort
   (``np.bincount`` of the expert ids and a stable ``argsort``).
3. For each expert with tokens: its tokens' rows are gathered, multiplied by ``w13`` in ONE call of the
   compiled quantized GEMM (:func:`hal_cpu.ops.quantized_gemm.gemm`: W4A16, W4A8 with ``activations='int8'``,
   or W8A8; the expert's weights are read once per call whatever its number of tokens), the two halves go
   through the compiled gated activation (:func:`hal_cpu.ops.gated_activation.gated`, float32), then one
   GEMM by ``w2``; the rows, scaled by their routing weights, are added into a float32 output (a token
   meets each expert at most once).
4. The output is rounded once to the hidden dtype.

One token (decode) skips the grouping: its ``top_k`` experts run in expert order with the same operations on
the same row as the grouped loop, so with the same bits.

Experts without tokens are never touched. Allocated per call: the routing arrays, and per expert its
gathered rows, ``[n, 2 * intermediate]`` and ``[n, intermediate]`` and ``[n, hidden]`` floats (``n``: its
tokens), plus the float32 output. Without the compiled library the GEMM and the activation use their
numpy fallbacks.
"""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall
from hal_core.ops.fused_moe import int8_activations, routing_of
from hal_core.ops.gated_activation import activation_of
from hal_core.quant import ExpertWeights

from ._common import finish
from .gated_activation import gated
from .quantized_gemm import gemm

__all__ = ["fused_moe", "moe", "route"]


def fused_moe(call: OpCall) -> np.ndarray:
    """The registered implementation (int4 and int8 experts, every routing and activation)."""
    return finish(call, moe(np.asarray(call["hidden_states"]), np.asarray(call["router_logits"]), call["experts"],
                            int(call["top_k"]), routing_of(call.args), activation_of(call.args),
                            "int8" if int8_activations(call.args) else "float"))


def route(logits: np.ndarray, top_k: int, routing: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [T, top_k] int64, weights [T, top_k] float32)`` of validated logits (float32 arithmetic)."""
    values = logits.astype(np.float32, copy=False)
    ids = np.argsort(-values, axis=1, kind="stable")[:, :top_k]  # NaN sorts last; ties keep index order
    picked = np.take_along_axis(values, ids, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        if routing == "topk_softmax":
            weights = np.exp(picked - picked.max(axis=1, keepdims=True))
            return ids, weights / weights.sum(axis=1, keepdims=True)
        top = values.max(axis=1, keepdims=True)
        weights = np.exp(picked - top) / np.exp(values - top).sum(axis=1, keepdims=True)
        if routing == "softmax_topk_renorm":
            weights = weights / weights.sum(axis=1, keepdims=True)
    return ids, weights.astype(np.float32, copy=False)


def moe(x: np.ndarray, logits: np.ndarray, experts: ExpertWeights, top_k: int, routing: str = "softmax_topk",
        activation: str = "silu", activations: str = "float") -> np.ndarray:
    """The MoE layer of validated host inputs as float32 ``[num_tokens, hidden]`` (``activations``: ``'int8'`` runs
    int4 experts as W4A8; int8 experts always run W8A8)."""
    tokens, hidden = x.shape
    inter = experts.shape[2]
    out = np.zeros((tokens, hidden), dtype=np.float32)
    if tokens == 0:
        return out
    ids, weights = route(logits, top_k, routing)
    if tokens == 1:  # decode: the token meets each of its top_k (distinct) experts once, no grouping to do
        for j in np.argsort(ids[0]).tolist():  # in expert order, as the grouped loop below adds them
            expert = int(ids[0, j])
            h = gemm(x, experts.w13[expert], activations=activations)
            y = gemm(gated(h[:, :inter], h[:, inter:], activation), experts.w2[expert], activations=activations)
            y *= weights[0, j]
            out += y
        return out
    flat_ids = ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    order = np.argsort(flat_ids, kind="stable")  # the pairs grouped by expert, token order kept within each
    counts = np.bincount(flat_ids, minlength=experts.num_experts)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    for e in np.flatnonzero(counts):
        pairs = order[bounds[e]:bounds[e + 1]]
        rows = pairs // top_k
        h = gemm(x[rows], experts.w13[e], activations=activations)  # float32 [n, 2 * inter]
        act = gated(h[:, :inter], h[:, inter:], activation)
        y = gemm(act, experts.w2[e], activations=activations)  # float32 [n, hidden]
        y *= flat_weights[pairs][:, None]
        out[rows] += y  # rows are distinct within one expert
    return out
