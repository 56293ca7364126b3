"""One decoder step of a Llama-architecture model, every op through the backend's ``ops`` (no torch).

Per layer: ``rms_norm`` (fused with the residual add from the second norm
on), one ``quantized_gemm`` for q/k/v, ``rotary_embedding`` in place on the
query and key views of its output, ``write_kv_cache``, ``paged_attention``,
``quantized_gemm`` for the output projection, ``rms_norm`` with the
residual, one ``quantized_gemm`` for gate/up, ``gated_activation`` on its two
halves (views, no copy) and ``quantized_gemm`` for down. Then the final norm
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
from ._weights import ModelWeights, embedding_rows

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
            q = qkv[:, :c.q_size].reshape(t, c.num_heads, c.head_size)
            k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(t, c.num_kv_heads, c.head_size)
            v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_kv_heads, c.head_size)
            op.rotary(positions=positions, query=q, key=k)
            op.write(key=k, value=v, slot_mapping=step.slot_mapping)
            attn = op.attend(query=q, **attention_args)
            x = op.o(x=attn.reshape(t, c.q_size))
            h = op.mlp_norm(x=x, residual=residual)
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
                gate_up=ops.bind("quantized_gemm", qweight=w.gate_up, **gemm),
                act=ops.bind("gated_activation", activation=c.activation),
                down=ops.bind("quantized_gemm", qweight=w.down, **gemm)))
        bound = (layers, ops.bind("rms_norm", weight=self.weights.final_norm, epsilon=c.rms_norm_eps),
                 ops.bind("quantized_gemm", qweight=self.weights.lm_head, **gemm))
        self._bound = (cache, bound)
        return bound


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
    gate_up: BoundOp
    act: BoundOp
    down: BoundOp
