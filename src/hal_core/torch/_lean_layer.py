"""``kernelize``'s decoder layers: a Llama-style layer's eager CPU step as its hal calls, without module plumbing.

Once :func:`~hal_core.torch.kernelize` has put a layer's norms, MLP
activation, rotary embedding and fused projections on hal, a decode step of
the layer still passes through a dozen ``nn.Module`` calls, transformers'
attention forward (views, transposes, the attention-function look-up), the
fused projections' hand-over between siblings and the rotary function's
copies of its inputs. At batch 1 that Python costs about as much as the
layer's GEMVs take from memory on a small model. :class:`LeanLayer`
replaces the layer's ``forward`` with the same sequence of calls made
directly:

- ``input_layernorm`` (its ``forward``, hal's ``rms_norm``);
- one fused q/k/v GEMM (Qwen3: each query and key head through its
  ``q_norm``/``k_norm``); the query and key rotated in place (they are this
  call's own tensors: no copy), the value a view of the GEMM's result;
- the cache's ``update`` and the model's attention function, with the
  arguments the architecture's attention forward passes (Mistral and Qwen2
  their ``sliding_window``); ``o_proj``;
- the residual add, ``post_attention_layernorm``, one fused gate/up GEMM,
  hal's ``gated_activation``, ``down_proj``, the residual add.

Where every norm's weight has the input's dtype and lives on the CPU (what
kernelize's norms need to run on hal at all), the calls run on numpy views
(the numpy lane): the hidden states become a numpy view once, each hal call
takes and returns numpy arrays (a projection's bias added in place, cast to
the result's dtype as its ``forward`` casts it), and with a
:class:`~hal_core.torch.transformers.HalPagedCache` on a host backend the
cache's update and hal's attention take numpy rows too
(:func:`~hal_core.torch.transformers.attend_rows`): torch then sees the
layer's input and result only (with another cache or attention function, the
query, key and value as torch views, and the attention's output). Inside a
model every call follows a GEMM that has just streamed megabytes of weights
through the caches, so each torch op between two hal calls is read back from
memory (``benchmarks/cold_calls.py``: after 32 MB streamed,
``QuantLinear.forward`` costs 70-120 µs more than its bound op, against 15 µs
back to back); the lane makes the torch ops of a layer a handful. The first
residual add is the ``post_attention_layernorm``'s fused one (``rms_norm``
with ``residual``: the same rounded sum), the last a numpy add of the same
dtype.

Every op, operand and rounding is the one the kernelized layer runs, so the
outputs are bit for bit the same (tested; in the numpy lane a NaN made by a
residual add of two infinities may carry the other sign). The lean path is
taken only where that holds, checked on every call: no autograd, no trace, a
CPU float input ``[batch, seq, hidden]``, the ``cos``/``sin`` the rotary
kernel takes, both fused groups intact, the MLP's ``forward`` still
kernelize's, the attention's its class's, the architecture's rotary function
still kernelize's, no forward hook on any module involved (nor a global one,
nor training mode; transformers' own output-capturing hooks count only while
they record). Anything else runs the layer's original ``forward``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.modules import module as _torch_module

from ..interop import host_view
from ..ops import BoundOp
from ._convert import to_tensor
from ._held_calls import held_bound, rotary_arrays, rotary_table, version_of
from ._host import HostRoute, route_for

__all__ = ["LAYERS", "LayerCode", "LeanLayer", "lean_problem"]

class LayerCode(NamedTuple):
    """What a decoder-layer class's attention forward does beyond Llama's (the lean forward copies it)."""

    #: where its ``sliding_window`` argument comes from: None (it passes none), ``"config"``
    #: (``config.sliding_window``) or ``"module"`` (the attention module's own attribute)
    window_from: str | None = None
    #: whether it normalises each query and key head (``q_norm``/``k_norm`` over the head size) before rotary
    head_norms: bool = False


#: Decoder-layer classes the lean forward serves, with what their attention forward adds to Llama's.
LAYERS: dict[str, LayerCode] = {"LlamaDecoderLayer": LayerCode(), "MistralDecoderLayer": LayerCode("config"),
                                "Qwen2DecoderLayer": LayerCode("module"),
                                "Qwen3DecoderLayer": LayerCode("module", head_norms=True)}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: numpy dtype name -> the torch dtype (the numpy lane casts a bias to its result's dtype)
_TORCH_OF = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def lean_problem(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` (after kernelize's other replacements) cannot take the lean forward, or None."""
    cls = type(layer).__name__
    if cls not in LAYERS:
        return f"{cls} is not one of the decoder layers hal runs whole ({', '.join(LAYERS)})"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return "no self_attn or mlp"
    groups = [getattr(getattr(attn, "q_proj", None), "_hal_group", None),
              getattr(getattr(mlp, "gate_proj", None), "_hal_group", None)]
    if any(group is None for group in groups):
        return "its q/k/v or gate/up projections are not fused"
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if LAYERS[cls].head_norms:
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if not all(getattr(norm, "__hal_kernelized__", False) for norm in norms):
        return "its norms are not on hal"
    if not getattr(mlp, "__hal_kernelized__", False):
        return "its MLP is not on hal"
    if "forward" in vars(attn):
        return "its attention's forward was replaced"
    return None


class LeanLayer:
    """A decoder layer's ``forward`` as its hal calls (see the module docs); made by :func:`kernelize`.

    ``original`` is the layer's forward before (what any call the lean path does not serve runs);
    ``activation`` the MLP's gated activation (hal's name).
    """

    def __init__(self, layer: torch.nn.Module, original: Callable[..., Any], activation: str) -> None:
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        self.layer, self.original, self.activation = layer, original, activation
        self.attn, self.mlp = attn, mlp
        self.qkv, self.gate_up = attn.q_proj._hal_group, mlp.gate_proj._hal_group
        self.members = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        self.norms: tuple[Any, Any] = (layer.input_layernorm, layer.post_attention_layernorm)
        code = LAYERS[type(layer).__name__]
        #: the attention's per-head query and key norms (Qwen3), or None
        self.head_norms: tuple[Any, Any] | None = (attn.q_norm, attn.k_norm) if code.head_norms else None
        self.mlp_forward = vars(mlp)["forward"]
        self.attn_class_forward = type(attn).forward
        #: Every module whose hooks the lean path would skip.
        self.modules: tuple[Any, ...] = (attn, *self.members[:3], attn.o_proj, mlp, *self.members[3:],
                                         mlp.down_proj, *self.norms, *(self.head_norms or ()))
        self.head_dim = int(attn.head_dim)
        self.modeling: Any = importlib.import_module(type(attn).__module__)
        self.eager_attention = self.modeling.eager_attention_forward
        self.window_from = code.window_from
        self._rotary: list[Any] = []  # the bound rotary_embedding (held_bound)
        self._activation: list[Any] = []  # the bound gated_activation
        #: the numpy lane's norms (input, post-attention, then Qwen3's query and key head norms), each one's bound
        #: rms_norm and epsilon (as kernelize's norms read it), and the projections whose biases it adds
        self.all_norms: tuple[Any, ...] = (*self.norms, *(self.head_norms or ()))
        self._norm_ops: tuple[list[Any], ...] = tuple([] for _ in self.all_norms)
        self.epsilons = tuple(float(getattr(n, "variance_epsilon", getattr(n, "eps", 1e-6))) for n in self.all_norms)
        self.projections: tuple[Any, ...] = (*self.members, attn.o_proj, mlp.down_proj)
        #: per projection with a bias: ((its _version, data_ptr, dtype), the bias, its numpy view in that dtype)
        self._biases: dict[Any, tuple[Any, torch.Tensor, np.ndarray]] = {}
        from . import transformers as hal_tf  # imports transformers: a model with decoder layers has it loaded

        self.attend_rows, self.rows_served = hal_tf.attend_rows, hal_tf.rows_served
        #: Calls the lean path served, those of them that ran as numpy calls, and those whose attention took numpy
        #: rows too (the tests read them).
        self.calls = self.host_calls = self.row_attention_calls = 0
        #: False: the lean path makes its calls on torch tensors even where the numpy lane applies (comparisons).
        self.numpy_lane = True

    # -- when ---------------------------------------------------------------------------------------------------

    def _ready(self, x: torch.Tensor, position_embeddings: Any) -> bool:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or self.layer.training:
            return False
        if not x.is_cpu or x.dim() != 3 or x.dtype not in _FLOATS:
            return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        for m in self.modules:
            if m._forward_pre_hooks or (m._forward_hooks and not _idle_capture(m._forward_hooks)):
                return False
        attn, mlp = self.attn, self.mlp
        if vars(mlp).get("forward") is not self.mlp_forward or "forward" in vars(attn) \
                or type(attn).forward is not self.attn_class_forward \
                or not hasattr(self.modeling.apply_rotary_pos_emb, "__hal_original__"):
            return False  # a piece runs other code than kernelize put there
        if any(m.__dict__.get("_hal_group") is None for m in self.members) or attn.q_proj._hal_group is not self.qkv \
                or mlp.gate_proj._hal_group is not self.gate_up or not self.qkv.intact() or not self.gate_up.intact():
            return False
        if not isinstance(position_embeddings, tuple) or len(position_embeddings) != 2:
            return False
        cos, sin = position_embeddings
        b, s, _ = x.shape
        return (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dim() == 3
                and cos.shape[-1] == self.head_dim and cos.shape[0] in (1, b) and cos.shape[1] == s
                and sin.shape == cos.shape and cos.is_cpu and not cos.requires_grad)

    # -- the step -------------------------------------------------------------------------------------------------

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if not self._ready(hidden_states, position_embeddings):
            return self.original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        assert position_embeddings is not None
        self.calls += 1
        attn, d = self.attn, self.head_dim
        b, s, _ = hidden_states.shape
        interface = _attention_functions().get_interface(attn.config._attn_implementation, self.eager_attention)
        extra: dict[str, Any] = {}
        if self.window_from == "config":
            extra["sliding_window"] = getattr(attn.config, "sliding_window", None)
        elif self.window_from == "module":
            extra["sliding_window"] = attn.sliding_window
        lane = self._numpy_lane(hidden_states)
        if lane is not None:  # the same ops on numpy views: no torch op between them (see the module docs)
            self.host_calls += 1
            route, residual = lane
            q_rows, k_rows, v_rows = self._host_qkv(route, residual, position_embeddings, b)
            if past_key_values is not None and self.rows_served(past_key_values, interface):
                self.row_attention_calls += 1
                out_rows = self.attend_rows(attn, past_key_values, q_rows, k_rows, v_rows, attention_mask,
                                            attn.scaling, hidden_states.dtype, b, s,
                                            {**extra, "position_ids": position_ids, "use_cache": use_cache,
                                             **kwargs})
                return self._host_mlp(route, residual, out_rows.reshape(b * s, -1), hidden_states.shape)
            query, key, value = (to_tensor(r).view(b, s, -1, d).transpose(1, 2) for r in (q_rows, k_rows, v_rows))
        else:
            x = self.norms[0].forward(hidden_states)
            self.members[0]._check_input(x)
            q, k, v = self.qkv.outputs(x, True)
            assert q is not None and k is not None and v is not None
            if self.head_norms is not None:  # each head normalised (new tensors, this call's own), then rotated
                q = self.head_norms[0].forward(q.view(b, s, -1, d))
                k = self.head_norms[1].forward(k.view(b, s, -1, d))
            q, k = q.reshape(b * s, -1, d), k.reshape(b * s, -1, d)
            self._rotate(q, k, *position_embeddings, b)
            query = q.view(b, s, -1, d).transpose(1, 2)
            key = k.view(b, s, -1, d).transpose(1, 2)
            value = v.view(b, s, -1, d).transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, attn.layer_idx)
        out, _ = interface(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **extra,
                           position_ids=position_ids, use_cache=use_cache, **kwargs)
        if lane is not None and out.dtype is hidden_states.dtype and out.is_cpu:
            rows = np.ascontiguousarray(host_view(out, "attn_output").reshape(b * s, -1))
            return self._host_mlp(*lane, rows, hidden_states.shape)
        h = hidden_states + attn.o_proj.forward(out.reshape(b, s, -1).contiguous())
        x = self.norms[1].forward(h)
        self.members[3]._check_input(x)
        gate, up = self.gate_up.outputs(x, True)
        assert gate is not None and up is not None
        return h + self.mlp.down_proj.forward(self._act(gate, up))

    # -- the numpy lane -------------------------------------------------------------------------------------------

    def _numpy_lane(self, hidden_states: torch.Tensor) -> tuple[HostRoute, np.ndarray] | None:
        """``(route, hidden_states as numpy rows [T, hidden])`` where the layer runs as numpy calls: every norm's
        weight of the input's dtype on the CPU, every bias too; else None."""
        dtype = hidden_states.dtype
        if not self.numpy_lane:
            return None
        for norm in self.all_norms:
            weight = norm._parameters.get("weight")
            if weight is None or weight.dtype is not dtype or not weight.is_cpu:
                return None
        for member in self.projections:
            bias = member._parameters.get("bias")
            if bias is not None and not bias.is_cpu:
                return None
        rows = host_view(hidden_states, "hidden_states")
        return route_for(hidden_states), rows.reshape(-1, rows.shape[-1])

    def _norm_bound(self, index: int, route: HostRoute) -> BoundOp:
        """Norm ``index`` of :attr:`all_norms` as kernelize's norm binds it: ``rms_norm`` with its weight."""
        weight = self.all_norms[index]._parameters["weight"]
        return held_bound(self._norm_ops[index], route, "rms_norm", (weight, weight.data_ptr(), weight.dtype),
                          weight=route.native(weight, "weight"), epsilon=self.epsilons[index])

    def _add_biases(self, y: np.ndarray, members: tuple[Any, ...], sizes: list[int]) -> None:
        """Each member's bias added to its columns of ``y`` in place, as its ``forward`` adds it (the bias cast to
        the result's dtype first); the cast is kept per bias and dtype while the bias is unchanged."""
        start = 0
        for member, size in zip(members, sizes, strict=True):
            bias = member._parameters.get("bias")
            if bias is not None:
                key = (version_of(bias), bias.data_ptr(), y.dtype)
                held = self._biases.get(member)
                if held is None or held[0] != key or held[1] is not bias:
                    cast = bias.detach().to(_TORCH_OF[y.dtype.name])
                    held = self._biases[member] = (key, bias, host_view(cast, "bias"))
                np.add(y[:, start:start + size], held[2], out=y[:, start:start + size])
            start += size

    def _host_qkv(self, route: HostRoute, hidden: np.ndarray, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input norm, fused q/k/v GEMM (biases added), per-head norms where the layer has them, and rotary, on numpy
        views: ``(query, key, value)`` as ``[T, heads, D]`` arrays (views of the GEMM's result, or the head norms'
        results), the query and key rotated in place."""
        d = self.head_dim
        x = self._norm_bound(0, route)(x=hidden)
        qkv = self.qkv.host_bound(route)(x=x)
        self._add_biases(qkv, self.members[:3], self.qkv.sizes)
        heads = qkv.reshape(qkv.shape[0], -1, d)  # the GEMM's own C-contiguous result: a view
        nq, nk = self.qkv.sizes[0] // d, self.qkv.sizes[1] // d
        q, k, v = heads[:, :nq], heads[:, nq:nq + nk], heads[:, nq + nk:]
        if self.head_norms is not None:  # each head's row normalised (new arrays, this call's own)
            q = self._norm_bound(2, route)(x=q.reshape(-1, d)).reshape(q.shape)
            k = self._norm_bound(3, route)(x=k.reshape(-1, d)).reshape(k.shape)
        positions, table = rotary_arrays(*position_embeddings, batch)
        rotary = held_bound(self._rotary, route, "rotary_embedding", ())
        rotary(positions=positions, query=q, cos_sin_cache=table, key=k)
        return q, k, v

    def _host_mlp(self, route: HostRoute, hidden: np.ndarray, attn_rows: np.ndarray,
                  shape: torch.Size) -> torch.Tensor:
        """The layer from ``o_proj`` on (``attn_rows``: the attention's output as ``[T, heads * D]`` rows) as numpy
        calls; the result ``[B, S, hidden]`` as a torch tensor."""
        o_proj, down_proj = self.attn.o_proj, self.mlp.down_proj
        o = o_proj._host_bound(route)(x=attn_rows)
        self._add_biases(o, (o_proj,), [o.shape[1]])
        x = self._norm_bound(1, route)(x=hidden, residual=o)  # o becomes hidden + o, rounded as torch's add rounds
        gate_up = self.gate_up.host_bound(route)(x=x)
        self._add_biases(gate_up, self.members[3:], self.gate_up.sizes)
        split = self.gate_up.sizes[0]
        act = held_bound(self._activation, route, "gated_activation", (), activation=self.activation)
        y = down_proj._host_bound(route)(x=act(gate=gate_up[:, :split], up=gate_up[:, split:]))
        self._add_biases(y, (down_proj,), [y.shape[1]])
        np.add(o, y, out=o)
        return to_tensor(o.reshape(shape))  # a numpy view: one torch op fewer

    # -- the module-by-module calls -------------------------------------------------------------------------------

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int) -> None:
        """The query and key rows ``[T, heads, D]`` rotated in place (kernelize's rotary replacement's kernel call,
        on this call's own tensors: no copy)."""
        positions, table = rotary_table(cos, sin, batch)
        bound = held_bound(self._rotary, route_for(q), "rotary_embedding", ())
        bound(positions=host_view(positions, "positions"), query=host_view(q, "query"),
              cos_sin_cache=host_view(table, "cos_sin_cache"), key=host_view(k, "key"))

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` through the bound ``gated_activation`` (kernelize's MLP replacement's call)."""
        shape = gate.shape
        g, u = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        bound = held_bound(self._activation, route_for(g), "gated_activation", (), activation=self.activation)
        return to_tensor(bound(gate=host_view(g, "gate"), up=host_view(u, "up"))).view(shape)


def _idle_capture(hooks: Any) -> bool:
    """Whether ``hooks`` are only transformers' output-capturing hooks, none recording now.

    transformers installs them for good on a model's first ``output_hidden_states`` / ``output_attentions``
    forward; they record only while a forward that asked for outputs runs (its collector holds what it asked
    for). Such a forward runs module by module, so every hook sees what it records.
    """
    for hook in hooks.values():
        if getattr(hook, "__module__", None) != _CAPTURE_MODULE or getattr(hook, "__name__", None) != _CAPTURE_HOOK:
            return False
    from transformers.utils.output_capturing import _active_collector

    return not _active_collector.get()  # None, or a forward's empty collector: nothing asked for


_CAPTURE_MODULE, _CAPTURE_HOOK = "transformers.utils.output_capturing", "output_capturing_hook"


def _attention_functions() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS
