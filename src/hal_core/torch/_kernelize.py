"""``kernelize(model)``: a loaded transformers model's norms, gated MLP activations and rotary embedding on hal ops.

The way transformers swaps kernels in for layers (its hub-kernels mapping of
layer names such as ``RMSNorm``), without editing model code and without the
``kernels`` package: each layer transformers names is matched by its class
and its config, and its ``forward`` is replaced on that module (the model's
other instances are untouched):

- ``*RMSNorm`` layers of the architectures in :data:`NORMS` -> ``rms_norm``
  (``weight_offset`` 1 for Gemma-style norms);
- ``*MLP`` layers with ``gate_proj``/``up_proj``/``down_proj`` and a gated
  ``hidden_act`` hal runs -> ``gated_activation`` between the projections;
- sibling projections that read the same input (an attention layer's
  ``q_proj``/``k_proj``/``v_proj``, an MLP's ``gate_proj``/``up_proj``, all
  ``QuantLinear`` of one format) -> one fused ``quantized_gemm`` each
  (:mod:`._fused_projections`: the members' buffers become views of one
  fused weight, no copy kept; ``fuse=False`` leaves them apart);
- a decoder layer of :data:`._lean_layer.LAYERS` whose pieces are all on
  hal (norms, MLP, both fused groups, rotary) -> a lean ``forward`` making
  the same hal calls without the module plumbing (:mod:`._lean_layer`);
- the rotary embedding (``apply_rotary_pos_emb`` of the architectures in
  :data:`ROTARY`) -> ``rotary_embedding`` on the query and key in place.
  That function is module-level in transformers, so it is replaced in the
  architecture's modeling module: every model of that architecture in the
  process then uses it, with the same results (it returns new tensors and
  leaves its inputs as they were, as the original does).

A call hal cannot run (a dtype the op refuses, autograd recording, another
layout) runs the layer's original code, so the model's outputs never
depend on whether hal ran. :func:`kernelize` returns what it replaced.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine._config import ACTIVATIONS
from ..interop import host_view
from ..ops import OPS
from ._convert import to_tensor
from ._fused_projections import fuse_siblings
from ._held_calls import held_bound, rotary_table
from ._host import eager_host, route_for
from ._lean_layer import LAYERS as LEAN_LAYERS
from ._lean_layer import LeanLayer, lean_problem
from ._ops import wrapper

__all__ = ["NORMS", "ROTARY", "KernelizeReport", "kernelize"]

#: RMSNorm classes hal runs, with their ``weight_offset`` (Gemma's norms scale by ``1 + weight``).
NORMS = {"LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0, "Qwen3RMSNorm": 0.0}
#: Modeling modules whose ``apply_rotary_pos_emb`` is the NeoX-style rotation over the whole head.
ROTARY = ("llama", "mistral", "qwen2", "qwen3")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class KernelizeReport:
    """What :func:`kernelize` replaced: module names per kind, and the rotary modules patched."""

    norms: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    rotary: list[str] = field(default_factory=list)
    #: module name -> the projections fused into one GEMM (``["q_proj", "k_proj", "v_proj"]``)
    fused: dict[str, list[str]] = field(default_factory=dict)
    #: decoder layers whose eager CPU calls run as their hal calls (:mod:`._lean_layer`)
    layers: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  #: module name -> why it kept its code


#: Each op's torch-operator function, made once (:func:`kernelize` makes them, so a compiled forward only reads this
#: dict: making one registers operators under a lock, which a trace cannot enter).
_made_ops: dict[str, Callable[..., Any]] = {}


def _op(name: str) -> Callable[..., Any]:
    found = _made_ops.get(name)
    if found is None:
        found = _made_ops[name] = wrapper(OPS[name])
    return found


def _eligible(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)) and all(
        t.dtype == first.dtype and t.device == first.device for t in tensors) and first.dtype in _FLOATS


def _norm_forward(module: Any, original: Callable[..., Any], offset: float) -> Callable[..., Any]:
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    options = {"weight_offset": offset} if offset else {}
    # The bound rms_norm and what it was bound for: (weight Parameter, its data_ptr, dtype, shape, backend, the
    # bound op). .to() keeps the Parameter and replaces its data, so the address and dtype are compared too.
    held: list[Any] = [None]

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        last = held[0]
        if (last is not None and last[0] is weight and hidden_states.dtype is last[2] and last[1] == weight.data_ptr()
                and hidden_states.shape[-1] == last[3] and eager_host(hidden_states, weight)):
            route = route_for(hidden_states)
            if route.backend is last[4]:  # the common case: a step's norms, nothing changed since the last one
                rows = hidden_states.reshape(-1, last[3])
                return to_tensor(last[5](x=host_view(rows, "x"))).view(hidden_states.shape)
        if hidden_states.shape[-1] != weight.shape[0] or not _eligible(hidden_states, weight):
            return original(hidden_states)
        rows = hidden_states.reshape(-1, weight.shape[0])
        if eager_host(rows, weight):
            route = route_for(rows)
            bound = route.bind("rms_norm", weight=route.native(weight, "weight"), epsilon=eps, **options)
            held[0] = (weight, weight.data_ptr(), weight.dtype, weight.shape[0], route.backend, bound)
            out = to_tensor(bound(x=host_view(rows, "x")))
        else:
            out = _op("rms_norm")(rows, weight, eps, **options)
        assert out is not None
        return out.view(hidden_states.shape)

    return forward


def _mlp_forward(module: Any, original: Callable[..., Any], activation: str) -> Callable[..., Any]:
    held: list[Any] = []  # the bound gated_activation

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = module.gate_proj(x), module.up_proj(x)
        if not _eligible(gate, up):
            return module.down_proj(module.act_fn(gate) * up)
        shape = gate.shape
        g, u = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        if eager_host(g, u):
            bound = held_bound(held, route_for(g), "gated_activation", (), activation=activation)
            act = to_tensor(bound(gate=host_view(g, "gate"), up=host_view(u, "up")))
        else:
            act = _op("gated_activation")(g, u, activation=activation)
        assert act is not None
        return module.down_proj(act.view(shape))

    return forward


#: The bound rotary_embedding of the last host route (nothing fixed: it saves the front door's per-call work).
_rotary_bound: list[Any] = []


def _rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if (unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1]
                or not _eligible(q, k) or q.device != cos.device or torch.compiler.is_compiling()):
            return original(q, k, cos, sin, unsqueeze_dim)
        b, _, s, d = q.shape
        if cos.shape[0] not in (1, b) or cos.shape[1] != s or sin.shape != cos.shape:
            return original(q, k, cos, sin, unsqueeze_dim)
        positions, table = rotary_table(cos, sin, b)
        # [B, S, heads, D] copies rotated in place: the function returns new tensors, and a caller may read its
        # inputs again (one pass each; the eager sequence makes several)
        query = q.transpose(1, 2).clone(memory_format=torch.contiguous_format).view(b * s, -1, d)
        key = k.transpose(1, 2).clone(memory_format=torch.contiguous_format).view(b * s, -1, d)
        if eager_host(query, key):
            bound = held_bound(_rotary_bound, route_for(query), "rotary_embedding", ())
            bound(positions=host_view(positions, "positions"), query=host_view(query, "query"),
                  cos_sin_cache=host_view(table, "cos_sin_cache"), key=host_view(key, "key"))
        else:
            _op("rotary_embedding")(positions, query, table, key=key)
        return query.view(b, s, -1, d).transpose(1, 2), key.view(b, s, -1, d).transpose(1, 2)

    apply_rotary_pos_emb.__hal_original__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def kernelize(model: torch.nn.Module, *, fuse: bool = True) -> KernelizeReport:
    """Run ``model``'s norms, gated activations and rotary embedding on hal ops, and (``fuse``) its sibling
    ``QuantLinear`` projections as one GEMM each and, where every piece of a decoder layer is then on hal, the
    layer's eager steps as its hal calls (in place; idempotent).

    Returns a :class:`KernelizeReport`; layers hal does not run are listed in ``skipped`` with the reason.
    ``fuse=False`` keeps every projection its own GEMM (a model to be compiled with ``torch.compile``: there each
    fused member's call computes the whole fused GEMM, see :mod:`._fused_projections`).
    """
    if not isinstance(fuse, bool):
        raise TypeError(f"argument 'fuse': expected a bool, got {type(fuse).__name__}")
    report = KernelizeReport()
    for op in ("rms_norm", "gated_activation", "rotary_embedding"):
        _op(op)
    for name, module in model.named_modules():
        if fuse:
            fused, problem = fuse_siblings(module)
            if fused:
                report.fused[name] = fused
            elif problem is not None and not problem.endswith("already fused"):
                report.skipped[name] = problem
        if getattr(module, "__hal_kernelized__", False):
            continue
        cls = type(module).__name__
        if cls.endswith("RMSNorm"):
            if cls not in NORMS:
                report.skipped[name] = f"{cls} is not one of the norms hal runs ({', '.join(NORMS)})"
                continue
            module.forward = _norm_forward(module, module.forward, NORMS[cls])
            report.norms.append(name)
        elif cls.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            act = getattr(getattr(module, "config", None), "hidden_act", None)
            if act not in ACTIVATIONS:
                report.skipped[name] = f"hidden_act {act!r} is not a gated activation hal runs"
                continue
            module.forward = _mlp_forward(module, module.forward, ACTIVATIONS[act])
            report.mlps.append(name)
        else:
            continue
        module.__hal_kernelized__ = True
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ROTARY:
        modeling: Any = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        current = modeling.apply_rotary_pos_emb
        if not hasattr(current, "__hal_original__"):
            modeling.apply_rotary_pos_emb = _rotary(current)
        report.rotary.append(modeling.__name__)
        if fuse:
            _lean_layers(model, report)
    elif model_type is not None:
        report.skipped["apply_rotary_pos_emb"] = f"model_type {model_type!r} keeps transformers' rotary embedding"
    return report


def _lean_layers(model: torch.nn.Module, report: KernelizeReport) -> None:
    """Give each decoder layer whose pieces are all on hal the lean forward (:mod:`._lean_layer`)."""
    for name, module in model.named_modules():
        if type(module).__name__ not in LEAN_LAYERS:
            continue
        if isinstance(vars(module).get("forward"), LeanLayer):
            continue  # kernelized before
        problem = lean_problem(module)
        if problem is not None:
            report.skipped[name] = f"runs module by module: {problem}"
            continue
        act = ACTIVATIONS[module.mlp.config.hidden_act]
        module.forward = LeanLayer(module, module.forward, act)
        report.layers.append(name)
