"""One decoder step of a Llama-architecture model, every op through the backend's ``ops`` (no torch).

Per layer: ``rms_norm`` (fused with the residual add from the second norm
on), one ``quantized_gemm`` for q/k/v, ``rotary_embedding`` in place on the
query and key views of its output, ``write_kv_cache``, ``paged_attention``,
``quantized_gemm`` for the output projection, ``rms_norm`` with the
residual, one ``quantized_gemm`` for gate/up, ``gated_activation`` on its two
halves (views, no copy) and ``quantized_gemm`` for down. Then the final norm
of each sequence's last row, the lm_head and ``sample``. Arrays stay on the
backend's device between ops; the step's token ids come in from the host and
the sampled tokens go back (one small copy each way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._backend import Backend
from ..kvcache import PagedKVCache, StepInputs
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

    def logits(self, ids: np.ndarray, step: StepInputs, cache: PagedKVCache, rows: np.ndarray) -> Any:
        """Run the step's token rows ``ids`` through every layer; the logits ``[len(rows), vocab]`` of token
        rows ``rows`` (each sampling sequence's last new row), on the backend."""
        c, be = self.config, self.backend
        ops = be.ops
        t = len(ids)
        positions = be.asarray(step.positions)
        x = embedding_rows(self.weights, be.asarray(ids) if not be.is_host else ids, self.dtype, be)
        residual = None
        attention_args = step.attention_args()
        for index, w in enumerate(self.weights.layers):
            if residual is None:
                residual = x
                h = ops.rms_norm(x, w.attn_norm, epsilon=c.rms_norm_eps)
            else:
                h = ops.rms_norm(x, w.attn_norm, epsilon=c.rms_norm_eps, residual=residual)
            qkv = ops.quantized_gemm(h, w.qkv, **self.gemm_options)
            q = qkv[:, :c.q_size].reshape(t, c.num_heads, c.head_size)
            k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(t, c.num_kv_heads, c.head_size)
            v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_kv_heads, c.head_size)
            ops.rotary_embedding(positions, q, self.cos_sin, key=k)
            key_cache, value_cache = cache.layer(index)
            ops.write_kv_cache(k, v, key_cache, value_cache, step.slot_mapping)
            attn = ops.paged_attention(q, key_cache, value_cache, scale=self.scale, **attention_args,
                                       **self.attention_options)
            x = ops.quantized_gemm(attn.reshape(t, c.q_size), w.o, **self.gemm_options)
            h = ops.rms_norm(x, w.mlp_norm, epsilon=c.rms_norm_eps, residual=residual)
            gate_up = ops.quantized_gemm(h, w.gate_up, **self.gemm_options)
            i = c.intermediate_size
            act = ops.gated_activation(gate_up[:, :i], gate_up[:, i:], activation=c.activation)
            x = ops.quantized_gemm(act, w.down, **self.gemm_options)
        assert residual is not None
        rows = rows if be.is_host else be.asarray(rows)
        x_last, r_last = x[rows], residual[rows]
        h = ops.rms_norm(x_last, self.weights.final_norm, epsilon=c.rms_norm_eps, residual=r_last)
        return ops.quantized_gemm(h, self.weights.lm_head, **self.gemm_options)
