"""One decoder step of :class:`ModelConfig`'s model, every op through the backend's ``ops`` (no torch).

Per layer: ``rms_norm`` (fused with the residual add from the second norm
on), one ``quantized_gemm`` for q/k/v, (Qwen3: ``rms_norm`` over each query
and key head, on copies of the two), ``rotary_embedding`` in place on the
query and key, ``write_kv_cache``, ``paged_attention``,
``quantized_gemm`` for the output projection, ``rms_norm`` with the
residual, then the MLP: one ``quantized_gemm`` for gate/up, ``gated_activation`` on its two
halves (views, no copy) and ``quantized_gemm`` for down; or a MoE block: the
router's logits (a float32 product of the array library, the one piece of a
step that is not a hal op: transformers keeps the router in float too) and one
``fused_moe`` call. Then the final norm
of each sequence's last row, the lm_head and ``sample``. Arrays stay on the
backend's device between ops; the step's token ids come in from the host and
the sampled tokens go back (one small copy each way). What every step passes
unchanged (weights, caches, options) is bound to each op once
(:meth:`Ops.bind <hal_core.ops.Ops.bind>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._backend import Backend
from ..kvcache import PagedKVCache, StepInputs
from ..ops import BoundOp
from ._config import ModelConfig
from ._weights import LayerWeights, ModelWeights, embedding_rows

__all__ = ["DecoderModel"]


class DecoderModel:
    """The forward pass of :class:`ModelConfig`'s model over a paged KV cache."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: Backend, *, dtype: np.dtype,
                 activations: str | None = None) -> None:
        self.config, self.weights, self.backend, self.dtype = config, weights, backend, dtype
        self.gemm_options = {} if activations is None else {"activations": activations}
        self.cos_sin = backend.asarray(config.rope.cos_sin_cache(config.max_position_embeddings))
        self.scale = config.head_size ** -0.5
        self.attention_options = {} if config.sliding_window is None else {"window": config.sliding_window}
        self._bound: tuple[PagedKVCache, tuple[list[_LayerOps], BoundOp, BoundOp]] | None = None

    def logits(self, ids: np.ndarray, step: StepInputs, cache: PagedKVCache, rows: np.ndarray) -> Any:
        """Run the step's token rows ``ids`` through every layer; the logits ``[len(rows), vocab]`` of token
        rows ``rows`` (each sampling sequence's last new row), on the backend."""
        c, be = self.config, self.backend
        layers, final_norm, lm_head = self._bound_ops(cache)
        t = len(ids)
        positions = be.asarray(step.positions)
        x = embedding_rows(self.weights, be.asarray(ids) if not be.is_host else ids, self.dtype, be)
        residual = None
        attention_args = step.attention_args()
        for op in layers:
            if residual is None:
                residual = x
                h = op.attn_norm(x=x)
            else:
                h = op.attn_norm(x=x, residual=residual)
            qkv = op.qkv(x=h)
            q, k = qkv[:, :c.q_size], qkv[:, c.q_size:c.q_size + c.kv_size]
            if op.q_norm is not None and op.k_norm is not None:  # per head: [t * heads, head_size] rows (a copy)
                q = op.q_norm(x=q.reshape(t * c.num_heads, c.head_size))
                k = op.k_norm(x=k.reshape(t * c.num_kv_heads, c.head_size))
            q = q.reshape(t, c.num_heads, c.head_size)
            k = k.reshape(t, c.num_kv_heads, c.head_size)
            v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_kv_heads, c.head_size)
            op.rotary(positions=positions, query=q, key=k)
            op.write(key=k, value=v, slot_mapping=step.slot_mapping)
            attn = op.attend(query=q, **attention_args)
            x = op.o(x=attn.reshape(t, c.q_size))
            h = op.mlp_norm(x=x, residual=residual)
            if op.moe is not None:
                x = op.moe(hidden_states=h, router_logits=self._router_logits(h, op.router))
            else:
                assert op.gate_up is not None and op.act is not None and op.down is not None
                gate_up = op.gate_up(x=h)
                i = c.intermediate_size
                x = op.down(x=op.act(gate=gate_up[:, :i], up=gate_up[:, i:]))
        assert residual is not None
        rows = rows if be.is_host else be.asarray(rows)
        x_last, r_last = x[rows], residual[rows]
        return lm_head(x=final_norm(x=x_last, residual=r_last))

    def _bound_ops(self, cache: PagedKVCache) -> tuple[list[_LayerOps], BoundOp, BoundOp]:
        """Every layer's ops with what each step passes unchanged bound once (:meth:`Ops.bind`: the weights, the
        layer's caches, the options), made again for another cache."""
        if self._bound is not None and self._bound[0] is cache:
            return self._bound[1]
        c, ops, gemm = self.config, self.backend.ops, self.gemm_options
        layers = []
        for index, w in enumerate(self.weights.layers):
            caches = dict(zip(("key_cache", "value_cache"), cache.layer(index), strict=True))
            layers.append(_LayerOps(
                attn_norm=ops.bind("rms_norm", weight=w.attn_norm, epsilon=c.rms_norm_eps),
                qkv=ops.bind("quantized_gemm", qweight=w.qkv, **gemm),
                rotary=ops.bind("rotary_embedding", cos_sin_cache=self.cos_sin),
                write=ops.bind("write_kv_cache", **caches),
                attend=ops.bind("paged_attention", **caches, scale=self.scale, **self.attention_options),
                o=ops.bind("quantized_gemm", qweight=w.o, **gemm),
                mlp_norm=ops.bind("rms_norm", weight=w.mlp_norm, epsilon=c.rms_norm_eps),
                q_norm=None if w.q_norm is None else ops.bind("rms_norm", weight=w.q_norm, epsilon=c.rms_norm_eps),
                k_norm=None if w.k_norm is None else ops.bind("rms_norm", weight=w.k_norm, epsilon=c.rms_norm_eps),
                **self._mlp_ops(w)))
        bound = (layers, ops.bind("rms_norm", weight=self.weights.final_norm, epsilon=c.rms_norm_eps),
                 ops.bind("quantized_gemm", qweight=self.weights.lm_head, **gemm))
        self._bound = (cache, bound)
        return bound

    def _router_logits(self, h: Any, router: Any) -> Any:
        """``h @ router.T`` in float32 (``router`` ``[num_experts, hidden]``). On the host with numpy's own loops
        (``einsum``), not its BLAS: a threaded BLAS call leaves its threads polling for the next one, and they take
        the cores from hal's pool for the rest of the step (a 128-token prompt of the ``moe`` benchmark model took
        1.5-2x as long). At hidden 1024 and 32 experts: about 1 ms a layer for 128 tokens, 15 us for one."""
        h = h.astype(np.float32, copy=False)
        if self.backend.is_host:
            return np.einsum("tk,ek->te", h, router)
        return h @ router.T

    def _mlp_ops(self, w: LayerWeights) -> dict[str, Any]:
        """A layer's MLP ops, bound: gate/up, the activation and down, or the MoE block's ``fused_moe``."""
        c, ops, gemm = self.config, self.backend.ops, self.gemm_options
        if w.experts is not None:
            assert c.moe is not None
            return {"router": w.router,
                    "moe": ops.bind("fused_moe", experts=w.experts, top_k=c.moe.top_k, routing=c.moe.routing,
                                    activation=c.activation, **gemm)}
        return {"gate_up": ops.bind("quantized_gemm", qweight=w.gate_up, **gemm),
                "act": ops.bind("gated_activation", activation=c.activation),
                "down": ops.bind("quantized_gemm", qweight=w.down, **gemm)}


@dataclass(frozen=True, slots=True)
class _LayerOps:
    """One decoder layer's ops, bound (:meth:`DecoderModel._bound_ops`)."""

    attn_norm: BoundOp
    qkv: BoundOp
    rotary: BoundOp
    write: BoundOp
    attend: BoundOp
    o: BoundOp
    mlp_norm: BoundOp
    q_norm: BoundOp | None = None
    k_norm: BoundOp | None = None
    gate_up: BoundOp | None = None
    act: BoundOp | None = None
    down: BoundOp | None = None
    router: Any = None  #: float32 ``[num_experts, hidden]``, with ``moe``, in a MoE layer
    moe: BoundOp | None = None
