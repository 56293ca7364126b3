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

One token (decode) skips the grouping: its ``top_k`` experts in expert order, each on the token's row. Where
every expert hit has at most :data:`~hal_cpu.ops._expert_mlps.MAX_ROWS` rows and there are at least as many
experts as threads (decode, small batches), steps 2 to 4 are one native call that runs each expert's three
calls on one thread, the experts spread over the threads, with their argument structs kept per experts value
(:mod:`hal_cpu.ops._expert_mlps`); the kernels, and so the bits, are the loop's.

Experts without tokens are never touched. Allocated per call: the routing arrays, and per expert its
gathered rows, ``[n, 2 * intermediate]`` and ``[n, intermediate]`` and ``[n, hidden]`` floats (``n``: its
tokens), plus the float32 output. Without the compiled library the GEMM and the activation use their
numpy fallbacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hal_core.ops import OpCall
from hal_core.ops.fused_moe import int8_activations, routing_of
from hal_core.ops.gated_activation import activation_of
from hal_core.quant import ExpertWeights

from .. import _native
from . import _expert_mlps
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
    out = np.zeros((tokens, hidden), dtype=np.float32)
    if tokens == 0:
        return out
    ids, weights = route(logits, top_k, routing)
    native = _native.try_load()
    if native is not None:
        found = _expert_mlps.combined(native, x, ids, weights, experts, activation, activations)
        if found is not None:
            return found
    hit, rows, scales = _groups(ids, weights, experts.num_experts)
    for e, r, w in zip(hit, rows, scales, strict=True):  # in expert order
        y = _expert(x[r], experts, e, activation, activations)
        y *= w[:, None]
        out[r] += y  # rows are distinct within one expert
    return out


def _groups(ids: np.ndarray, weights: np.ndarray,
            num_experts: int) -> tuple[list[int], list[Any], list[np.ndarray]]:
    """The experts hit, in increasing order, with each one's rows (an index array, or a slice for one token) and
    the routing weights of those rows."""
    tokens, top_k = ids.shape
    if tokens == 1:  # decode: the token meets each of its top_k (distinct) experts once
        order = np.argsort(ids[0]).tolist()
        return ([int(ids[0, j]) for j in order], [slice(0, 1)] * top_k,
                [weights[0, j:j + 1] for j in order])
    flat_ids = ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    order = np.argsort(flat_ids, kind="stable")  # the pairs grouped by expert, token order kept within each
    counts = np.bincount(flat_ids, minlength=num_experts)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    hit = np.flatnonzero(counts).tolist()
    pairs = [order[bounds[e]:bounds[e + 1]] for e in hit]
    return hit, [p // top_k for p in pairs], [flat_weights[p] for p in pairs]


def _expert(x: np.ndarray, experts: ExpertWeights, e: int, activation: str, activations: str) -> np.ndarray:
    """Expert ``e``'s gated MLP of rows ``x`` as float32 ``[n, hidden]``: two GEMM calls and the activation."""
    inter = experts.shape[2]
    h = gemm(x, experts.w13[e], activations=activations)  # float32 [n, 2 * inter]
    return gemm(gated(h[:, :inter], h[:, inter:], activation), experts.w2[e], activations=activations)
