"""Peers of the per-step ops: the torch eager sequences a transformers Llama runs where hal runs one op.

Each peer is exactly the unfused sequence of torch ops it replaces, so ``hal_speedup`` reads "hal against what
it replaces":

- ``rms_norm``: the decoder layer's ``residual + x`` (when the case has a residual), then ``LlamaRMSNorm``'s
  forward (``to(float32)``, ``pow(2).mean(-1, keepdim=True)``, ``* rsqrt(var + eps)``, ``weight * h.to(dtype)``);
- ``gated_activation``: ``F.silu(gate) * up`` (``F.gelu(gate)`` / ``F.gelu(gate, approximate="tanh")`` for the
  gelu variants);
- ``rotary_embedding``: ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, query and key) with ``cos``
  and ``sin`` as the rotary module returns them (``cat(freqs, freqs)`` per token, in the activations' dtype),
  gathered from the same table before timing: transformers computes them once per forward for every layer;
- ``sample``: the float32 copy of the logits generation makes, then the warpers generation applies for the
  row's settings (temperature, top-k by ``torch.topk``, top-p by ``torch.sort`` and ``cumsum``, min-p) and
  ``torch.multinomial`` on the softmax, or ``argmax`` for greedy. transformers takes one setting per batch, so
  a batch whose rows differ is ``missing``.

They run on host backends, under ``torch.inference_mode()``, with torch's intra-op threads set to the cores
this process may run on: the count hal's host kernels use unless told otherwise.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._cases import Case
from ._peer_base import Peer, PeerUnavailable, Runner, inference, rotating, to_torch, torch_module

__all__ = ["STEP_PEERS", "host_threads"]


def host_threads() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        return max(1, os.cpu_count() or 1)


def _step_torch() -> Any:
    torch = torch_module()
    if torch.get_num_threads() != host_threads():
        torch.set_num_threads(host_threads())
    return torch


def _ready(torch: Any, calls: Sequence[Callable[[], object]]) -> Runner:
    wrapped = [inference(torch, call) for call in calls]
    wrapped[0]()  # fails here, not while timing, when this torch cannot run it
    return rotating(wrapped)


# -- rms_norm -----------------------------------------------------------------


def llama_rms_norm(torch: Any, x: Any, weight: Any, eps: float, residual: Any = None) -> tuple[Any, Any]:
    """``(out, residual + x or None)``: the decoder layer's add, then ``LlamaRMSNorm.forward``."""
    if residual is not None:
        x = residual + x
        residual = x
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype), residual


def _rms_norm(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = _step_torch()
    calls: list[Callable[[], object]] = []
    for args in inputs:
        if args.get("weight_offset"):
            raise PeerUnavailable("the Llama norm has no weight offset (Gemma's norm is another sequence)")
        x, weight = to_torch(torch, args["x"]), to_torch(torch, args["weight"])
        residual = None if args.get("residual") is None else to_torch(torch, args["residual"])
        eps = float(args["epsilon"])
        calls.append(functools.partial(llama_rms_norm, torch, x, weight, eps, residual))
    return _ready(torch, calls)


# -- gated_activation ---------------------------------------------------------


def _gated(act: Callable[[Any], Any], gate: Any, up: Any) -> Any:
    return act(gate) * up


def _gated_activation(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = _step_torch()
    functional = torch.nn.functional
    acts: Mapping[str, Callable[[Any], Any]] = {
        "silu": functional.silu,
        "gelu": functional.gelu,
        "gelu_tanh": lambda g: functional.gelu(g, approximate="tanh"),
    }
    calls: list[Callable[[], object]] = []
    for args in inputs:
        act = acts[args.get("activation") or "silu"]
        gate, up = to_torch(torch, args["gate"]), to_torch(torch, args["up"])
        calls.append(functools.partial(_gated, act, gate, up))
    return _ready(torch, calls)


# -- rotary_embedding ---------------------------------------------------------


def rotary_cos_sin(torch: Any, table: np.ndarray, positions: np.ndarray, dtype: Any) -> tuple[Any, Any]:
    """``(cos, sin)`` ``[tokens, 1, rotary_dim]`` as transformers' rotary module returns them (``cat(freqs,
    freqs)``, cast to the activations' dtype), here gathered from hal's ``cos_sin_cache`` rows."""
    rows = torch.from_numpy(np.ascontiguousarray(table[np.asarray(positions).astype(np.int64)]))
    half = rows.shape[1] // 2
    cos, sin = rows[:, :half], rows[:, half:]
    return (torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1),
            torch.cat((sin, sin), dim=-1).to(dtype).unsqueeze(1))


def _rotate_half(torch: Any, x: Any) -> Any:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(torch: Any, x: Any, cos: Any, sin: Any) -> Any:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dimensions, the rest passed through (as
    transformers' partial-rotary models split and concatenate them)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (_rotate_half(torch, x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (_rotate_half(torch, x_rot) * sin), x_pass), dim=-1)


def _rotary_embedding(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = _step_torch()
    calls: list[Callable[[], object]] = []
    for args in inputs:
        if args.get("style") == "gptj":
            raise PeerUnavailable("apply_rotary_pos_emb rotates halves (neox); gptj pairs are another sequence")
        query = to_torch(torch, args["query"])
        key = None if args.get("key") is None else to_torch(torch, args["key"])
        cos, sin = rotary_cos_sin(torch, np.asarray(args["cos_sin_cache"]), args["positions"], query.dtype)

        def call(q: Any = query, k: Any = key, cos: Any = cos, sin: Any = sin) -> object:
            return apply_rotary(torch, q, cos, sin), None if k is None else apply_rotary(torch, k, cos, sin)

        calls.append(call)
    return _ready(torch, calls)


# -- sample -------------------------------------------------------------------


def _one_setting(args: Mapping[str, Any], name: str) -> float | None:
    value = args.get(name)
    if value is None:
        return None
    values = np.asarray(value)
    if values.size and (values != values.flat[0]).any():
        raise PeerUnavailable(f"transformers' warpers take one {name} per batch; this batch's rows differ")
    return float(values.flat[0]) if values.size else None


def transformers_sampler(torch: Any, args: Mapping[str, Any]) -> Callable[[Any], Any]:
    """The step transformers' generation runs on ``logits`` for the batch's one setting: float32 copy, then
    argmax (temperature 0) or the temperature, top-k, top-p and min-p warpers and ``multinomial``."""
    temperature = _one_setting(args, "temperature") or 0.0
    top_k, top_p, min_p = (None, None, None) if temperature == 0.0 else (  # greedy ignores them, as hal does
        _one_setting(args, n) for n in ("top_k", "top_p", "min_p"))
    vocab = int(args["logits"].shape[1])
    k = int(top_k) if top_k is not None and 0 < top_k < vocab else None
    p = top_p if top_p is not None and top_p < 1.0 else None
    m = min_p if min_p else None
    functional, ninf = torch.nn.functional, -float("inf")

    def step(logits: Any) -> Any:
        scores = logits.to(dtype=torch.float32, copy=True)
        if temperature == 0.0:
            return torch.argmax(scores, dim=-1)
        if temperature != 1.0:
            scores = scores / temperature
        if k is not None:
            scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], ninf)
        if p is not None:
            sorted_logits, sorted_indices = torch.sort(scores, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            sorted_remove = cumulative <= (1 - p)
            sorted_remove[..., -1:] = 0
            scores = scores.masked_fill(sorted_remove.scatter(1, sorted_indices, sorted_remove), ninf)
        if m is not None:
            probs = torch.softmax(scores, dim=-1)
            remove = probs < m * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
            scores = scores.masked_fill(remove, ninf)
        return torch.multinomial(functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)

    return step


def _sample(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = _step_torch()
    calls: list[Callable[[], object]] = []
    for args in inputs:
        step, logits = transformers_sampler(torch, args), to_torch(torch, args["logits"])
        calls.append(functools.partial(step, logits))
    return _ready(torch, calls)


def _on_host(op: str) -> Callable[[Case, bool], bool]:
    return lambda case, host: host and case.op == op


#: The per-step ops' peers, in table order (added to ``PEERS``).
STEP_PEERS: tuple[Peer, ...] = (
    Peer("torch eager LlamaRMSNorm (+ residual add)", _on_host("rms_norm"), _rms_norm),
    Peer("torch eager act(gate) * up", _on_host("gated_activation"), _gated_activation),
    Peer("torch eager apply_rotary_pos_emb", _on_host("rotary_embedding"), _rotary_embedding),
    Peer("torch eager sampling (warpers or argmax)", _on_host("sample"), _sample),
)
