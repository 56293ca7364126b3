"""``QuantMoE``: a mixture-of-experts block whose experts are hal's quantized format, run by ``fused_moe``.

The module keeps the block's router (``gate``, in float, called as the
original block calls it, so transformers' ``output_router_logits`` still
records its logits) and the experts as stacked buffers, one per array of
:class:`~hal_core.quant.ExpertWeights` (no float copy of an expert ever
exists):

==============  ==========================================  ===============================
buffer          int4 (W4A16)                                int8 (W8A8)
==============  ==========================================  ===============================
w13_qweight     int32 ``[E, H/8, 2I]`` (hal's uint32 bits)  uint8 ``[E, H, 2I]``
w13_scales      fp16/bf16/fp32 ``[E, H/G, 2I]``             same
w2_qweight      int32 ``[E, I/8, H]``                       uint8 ``[E, I, H]``
w2_scales       fp16/bf16/fp32 ``[E, I/G, H]``              same
w*_zeros        uint8, only with zero points                same
w*_g_idx        int32 ``[E, K]``, only with act-order       same
==============  ==========================================  ===============================

``forward`` computes the router logits and, on eager CPU tensors, calls
``backend.ops.fused_moe`` through the host route (:mod:`._host`), bound once
to the experts and the block's settings (:meth:`Ops.bind
<hal_core.ops.Ops.bind>`: the experts' arrays are checked once, not on
every call). ``activations`` is ``fused_moe``'s setting: None or
``"float"`` (W4A16 for int4 experts), ``"int8"`` (W4A8) or ``"auto"``
(the backend chooses per call); int8 experts are W8A8 either way. Any other
call (autograd recording, tensors on another device, a ``torch.compile``
trace) runs the same block composed in torch: routing with ``softmax`` /
``topk``, each hit expert's two projections with ``torch.ops.hal.quantized_gemm``
(which differentiates with respect to its input, with the block's
``activations``; under ``"auto"`` each expert's GEMM chooses by its own
rows) and the activation in float32. That fallback is counted per reason
in :attr:`QuantMoE.fallbacks`, logged once per reason, and raises
:class:`~hal_core.FallbackError` under ``HAL_STRICT=1``.
"""

from __future__ import annotations

import logging
from operator import is_not
from typing import Any

import torch

from .. import _env
from .._errors import ArgumentError, ArgumentTypeError, FallbackError
from ..interop import host_view
from ..ops.fused_moe import ROUTINGS
from ..ops.gated_activation import ACTIVATIONS
from ..quant import ExpertWeights, QuantizedWeight, quantize
from ._convert import to_tensor
from ._host import HostRoute, route_for
from ._input_checks import check_activation
from ._modules import _SCALE_DTYPES, check_activations
from ._moe_block import MoeSettings, block_problem, expert_tensors, moe_settings
from ._weights import _weight, weight_to_tensors

__all__ = ["QuantMoE", "quantize_block"]

log = logging.getLogger("hal")

_FIELDS = ("qweight", "scales", "zeros", "g_idx")
#: Fallback reasons already logged in this process.
_logged: set[str] = set()


def _stacked(weights: tuple[QuantizedWeight, ...], what: str) -> dict[str, torch.Tensor]:
    """Each array of ``weights`` stacked over the experts: ``{'qweight': [E, ...], ...}`` (None fields left out)."""
    per_expert = [weight_to_tensors(w) for w in weights]
    fields = set(per_expert[0])
    for e, tensors in enumerate(per_expert):
        if set(tensors) != fields:
            raise ArgumentError(f"argument 'experts': {what}[{e}] has arrays {sorted(tensors)}, expert 0 "
                             f"{sorted(fields)}; QuantMoE needs zero points and act-order alike in every expert")
    return {field: torch.stack([t[field] for t in per_expert]) for field in _FIELDS if field in fields}


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _route(logits: torch.Tensor, top_k: int, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, top_k], weights [T, top_k] float32)`` as ``fused_moe``'s routing (torch ops, differentiable)."""
    logits = logits.float()
    if routing == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(values, dim=-1)
    values, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if routing == "softmax_topk_renorm":
        values = values / values.sum(dim=-1, keepdim=True)
    return ids, values


class QuantMoE(torch.nn.Module):
    """A sparse MoE block: a float router and quantized experts run by ``fused_moe`` (see the module docs).

    :meth:`from_block` quantizes a transformers sparse MoE block
    (Qwen3-MoE, Mixtral); the constructor wraps a router and an
    :class:`~hal_core.quant.ExpertWeights`. ``forward`` takes
    ``hidden_states [..., hidden]`` (fp32, fp16 or bf16) and returns the
    same shape and dtype, as the block it replaces.
    """

    def __init__(self, gate: torch.nn.Module, experts: ExpertWeights, *, top_k: int, routing: str | None = None,
                 activation: str | None = None, name: str | None = None, jitter_noise: float = 0.0,
                 activations: str | None = None) -> None:
        super().__init__()
        if not isinstance(gate, torch.nn.Module):
            raise ArgumentTypeError(f"argument 'gate': expected the router (a torch.nn.Module), "
                                    f"got {type(gate).__name__}")
        if not isinstance(experts, ExpertWeights):
            raise ArgumentTypeError(f"argument 'experts': expected a hal_core.quant.ExpertWeights, "
                                    f"got {type(experts).__name__}")
        num_experts, hidden, inter = experts.shape
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ArgumentError(f"argument 'top_k': expected an int in [1, {num_experts}] (num_experts), got {top_k!r}")
        routing = routing or "softmax_topk"
        if routing not in ROUTINGS:
            raise ArgumentError(f"argument 'routing': expected one of {', '.join(ROUTINGS)}, got {routing!r}")
        activation = activation or "silu"
        if activation not in ACTIVATIONS:
            raise ArgumentError(f"argument 'activation': expected one of {', '.join(ACTIVATIONS)}, "
                                f"got {activation!r}")
        self.gate = gate
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, inter
        self.bits, self.group_size = experts.bits, experts.group_size
        self.top_k, self.routing, self.activation = top_k, routing, activation
        #: ``fused_moe``'s ``activations`` for every call (None / ``"float"``: W4A16; ``"int8"``: W4A8; ``"auto"``).
        self.activations = check_activations(activations)
        #: The block's qualified name in its model, for errors; None when unknown.
        self.name = name
        #: Multiplicative noise on the input in training mode (Mixtral's ``router_jitter_noise``), 0 for none.
        self.jitter_noise = float(jitter_noise)
        #: Calls that ran the torch composition instead of ``fused_moe``: reason -> calls.
        self.fallbacks: dict[str, int] = {}
        #: (the buffers, hal's experts over their numpy views): eager CPU calls reuse it.
        self._host_experts: tuple[tuple[Any, ...], ExpertWeights] | None = None
        #: (the buffers, the settings, fused_moe bound to them): eager CPU calls reuse it.
        self._host_op: tuple[tuple[Any, ...], tuple[Any, ...], Any] | None = None
        for prefix, weights in (("w13", experts.w13), ("w2", experts.w2)):
            for field, tensor in _stacked(weights, prefix).items():
                self.register_buffer(f"{prefix}_{field}", tensor)

    @classmethod
    def from_block(cls, block: torch.nn.Module, config: Any, *, bits: int = 4, group_size: int = 128,
                   symmetric: bool = True, scale_dtype: torch.dtype = torch.float16,
                   name: str | None = None, activations: str | None = None) -> QuantMoE:
        """Quantize a transformers sparse MoE block's experts (:data:`~hal_core.torch._moe_block.BLOCKS`).

        ``config`` is the model's config (``top_k``, routing and activation are read from it, see
        docs/engine-guide.md); ``bits``, ``group_size``, ``symmetric`` and ``scale_dtype`` as
        :func:`~hal_core.quant.quantize`, for every expert's ``w13`` and ``w2``; ``activations`` as the
        constructor's. The new module holds
        ``block.gate`` itself and the quantized experts on the router's device; ``block`` is left as it
        was. Each expert's float weight is read once (its float64 copy on the host is the only transient).
        """
        settings = moe_settings(block, config, name)
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ArgumentError(f"argument 'bits': expected 4 or 8, got {bits!r}")
        if scale_dtype not in _SCALE_DTYPES:
            raise ArgumentTypeError(f"argument 'scale_dtype': expected torch.float16, torch.bfloat16 or "
                                    f"torch.float32, got {scale_dtype}")
        problem = block_problem(block, bits=bits, group_size=group_size, symmetric=symmetric,
                                scale_dtype=scale_dtype)
        if problem is not None:
            raise ArgumentError(f"MoE block {name or type(block).__name__!r} cannot be quantized: {problem}")
        return quantize_block(block, settings, bits=bits, group_size=group_size, symmetric=symmetric,
                              scale_dtype=scale_dtype, name=name, activations=activations)

    # -- the experts ----------------------------------------------------------------

    def _buffer_tuple(self) -> tuple[torch.Tensor | None, ...]:
        found = self._buffers
        return tuple(found.get(f"{prefix}_{field}") for prefix in ("w13", "w2") for field in _FIELDS)

    def _expert(self, arrays: tuple[Any, ...], e: int) -> QuantizedWeight:
        qweight, scales, zeros, g_idx = (None if a is None else a[e] for a in arrays)
        return _weight(qweight, scales, zeros, g_idx, self.bits, self.group_size)

    def _experts(self, buffers: tuple[Any, ...]) -> ExpertWeights:
        w13, w2 = buffers[:4], buffers[4:]
        return ExpertWeights(tuple(self._expert(w13, e) for e in range(self.num_experts)),
                             tuple(self._expert(w2, e) for e in range(self.num_experts)))

    def expert_weights(self) -> ExpertWeights:
        """hal's :class:`~hal_core.quant.ExpertWeights` over this module's buffers (views, no copy)."""
        return self._experts(self._buffer_tuple())

    def _host(self, route: HostRoute) -> ExpertWeights:
        """The experts over numpy views of the buffers (:meth:`HostRoute.native`), built once and rebuilt when a
        buffer is replaced."""
        buffers = self._buffer_tuple()
        cached = self._host_experts
        if cached is None or any(map(is_not, cached[0], buffers)):
            views = tuple(None if t is None else route.native(t, "experts") for t in buffers)
            cached = self._host_experts = (buffers, self._experts(views))
        return cached[1]

    def _host_fused(self, route: HostRoute) -> Any:
        """``fused_moe`` bound to the host experts and this block's settings; made again when a buffer is replaced,
        a setting (``top_k``, ``routing``, ``activation``, ``activations``) or the backend changes."""
        buffers = self._buffer_tuple()
        settings = (route.backend, self.top_k, self.routing, self.activation, self.activations)
        cached = self._host_op
        if (cached is None or any(map(is_not, cached[0], buffers))
                or any(a is not b and a != b for a, b in zip(cached[1], settings, strict=True))):
            fixed: dict[str, Any] = {"experts": self._host(route), "top_k": self.top_k, "routing": self.routing,
                                     "activation": self.activation}
            if self.activations is not None:
                fixed["activations"] = self.activations
            cached = self._host_op = (buffers, settings, route.bind("fused_moe", **fixed))
        return cached[2]

    # -- running it -----------------------------------------------------------------

    def _describe(self) -> str:
        return f"QuantMoE {self.name!r}" if self.name else "QuantMoE"

    def _check_input(self, x: Any) -> None:
        """ArgumentError / ArgumentTypeError naming ``hidden_states`` and this block, before any work."""
        check_activation(x, "hidden_states", self._describe, self.hidden_size,
                         self._buffers["w13_qweight"], "the experts")  # type: ignore[arg-type]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.gate(rows)
        logits = out[0] if isinstance(out, tuple) else out
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (rows.shape[0], self.num_experts):
            raise ArgumentError(f"{self._describe()}: its router returned {getattr(logits, 'shape', logits)!r}, "
                                f"expected logits [{rows.shape[0]}, {self.num_experts}]")
        return logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., hidden]`` -> ``[..., hidden]`` in its dtype: ``fused_moe`` of the routed experts."""
        self._check_input(hidden_states)
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        rows = hidden_states.reshape(-1, self.hidden_size).contiguous()
        logits = self._logits(rows)
        if logits.dtype not in (torch.float32, rows.dtype):
            logits = logits.float()
        reason = _fallback_reason(rows, logits)
        if reason is None:
            route = route_for(rows)
            out = to_tensor(self._host_fused(route)(hidden_states=host_view(rows, "hidden_states"),
                                                    router_logits=host_view(logits.contiguous(), "router_logits")))
        else:
            self._fall_back(reason)
            out = self._composed(rows, logits)
        return out.view(hidden_states.shape)

    def _fall_back(self, reason: str) -> None:
        if _env.strict():
            raise FallbackError(f"{self._describe()}: {reason}; unset HAL_STRICT to allow it")
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if reason not in _logged:
            _logged.add(reason)
            log.warning("hal: QuantMoE runs its experts one quantized_gemm at a time, not fused_moe: %s", reason)

    def _composed(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The block in torch ops: the routing, then per hit expert ``quantized_gemm``s and the activation in fp32."""
        ids, weights = _route(logits, self.top_k, self.routing)
        w13, w2 = self._buffer_tuple()[:4], self._buffer_tuple()[4:]
        x = rows.float()
        out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        for e in torch.unique(ids).tolist():
            tokens, slots = torch.where(ids == e)
            h = torch.ops.hal.quantized_gemm(x[tokens], *(None if t is None else t[e] for t in w13), self.bits,
                                             self.group_size, self.activations)
            gated = _activate(h[:, :self.intermediate_size], self.activation) * h[:, self.intermediate_size:]
            y = torch.ops.hal.quantized_gemm(gated.contiguous(), *(None if t is None else t[e] for t in w2),
                                             self.bits, self.group_size, self.activations)
            out = out.index_add(0, tokens, y * weights[tokens, slots, None])
        return out.to(rows.dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, int{self.bits}, group_size={self.group_size}, "
                f"routing={self.routing}, activation={self.activation}"
                f"{f', activations={self.activations}' if self.activations else ''}")

    # -- keeping the format exact -----------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> QuantMoE:
        """Moves follow ``fn``; dtype casts reach the router only (the scales' dtype is part of the format)."""
        scales = {name: self._buffers[name] for name in ("w13_scales", "w2_scales")}
        super()._apply(fn, recurse)
        for name, before in scales.items():
            moved = self._buffers[name]
            if moved is not None and before is not None and moved.dtype != before.dtype:
                self._buffers[name] = before.to(moved.device)
        return self


def quantize_block(block: torch.nn.Module, settings: MoeSettings, *, bits: int, group_size: int, symmetric: bool,
                   scale_dtype: torch.dtype, name: str | None, activations: str | None = None) -> QuantMoE:
    """:meth:`QuantMoE.from_block` after its checks (``block_problem`` found nothing): the experts quantized one at
    a time, the module on the router's device."""
    gate_up, down = expert_tensors(block)
    group = gate_up.shape[2] if group_size == -1 else group_size
    options: dict[str, Any] = {"bits": bits, "group_size": group, "symmetric": symmetric,
                               "scale_dtype": _SCALE_DTYPES[scale_dtype]}
    experts = ExpertWeights(tuple(quantize(gate_up[e].T, **options) for e in range(gate_up.shape[0])),
                            tuple(quantize(down[e].T, **options) for e in range(down.shape[0])))
    gate: Any = block.gate
    module = QuantMoE(gate, experts, top_k=settings.top_k, routing=settings.routing, activation=settings.activation,
                      name=name, jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
                      activations=activations)
    return module.to(gate.weight.device)


def _fallback_reason(rows: torch.Tensor, logits: torch.Tensor) -> str | None:
    """Why this call cannot take ``fused_moe``'s host route, or None when it can."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile (fused_moe has no torch operator)"
    if not rows.is_cpu:
        return f"hidden_states on {rows.device.type} (fused_moe is called on host tensors)"
    if torch.is_grad_enabled() and (rows.requires_grad or logits.requires_grad):
        return "autograd records the call (run under torch.no_grad() or torch.inference_mode() for fused_moe)"
    return None

