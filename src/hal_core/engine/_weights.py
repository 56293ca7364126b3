"""An engine's weights from a checkpoint of :class:`ModelConfig`'s model: float safetensors (quantized at load)
or GPTQ.

The q/k/v projections are held as one ``[hidden, q + 2 kv]`` weight and
gate/up as one ``[hidden, 2 * intermediate]`` weight, so a dense layer makes
four ``quantized_gemm`` calls. A MoE layer holds its router in float32
(``[num_experts, hidden]``, as transformers keeps it in float) and each expert's
gate/up and down the same way, as the :class:`~hal_core.quant.ExpertWeights`
``fused_moe`` takes; where the checkpoint keeps them is
:data:`~hal_core.quant._moe_layout.MOE_LAYOUTS`. Quantization is per output column with groups
along the input, so joining columns changes no code: a float checkpoint's
columns get the codes :func:`hal_core.torch.quantize_model` gives them, and
a GPTQ checkpoint's stored codes are joined as they are (same bits and
groups; act-order checkpoints, whose row order differs per projection, are
refused). No float copy of a projection outlives its quantization; the
embedding stays the checkpoint's mapping on a host backend (only the rows a
step reads are touched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._backend import Backend
from .._errors import ArgumentError, CheckpointError, ConfigurationError
from ..quant import ExpertWeights, QuantizedWeight, quantize
from ..quant._checkpoint_format import KEY, CheckpointFormat, checkpoint_format
from ..quant._moe_layout import MOE_LAYOUTS
from ._checkpoint import Tensors
from ._config import ModelConfig

__all__ = ["LayerWeights", "ModelWeights", "embedding_rows", "load_weights"]


@dataclass
class LayerWeights:
    """One decoder layer on the backend: a dense MLP (``gate_up``, ``down``) or a MoE block (``router``,
    ``experts``)."""

    attn_norm: Any
    qkv: QuantizedWeight
    o: QuantizedWeight
    mlp_norm: Any
    gate_up: QuantizedWeight | None = None
    down: QuantizedWeight | None = None
    q_norm: Any = None  #: ``[head_size]``, with ``k_norm``, where the config normalises each head (Qwen3)
    k_norm: Any = None
    router: Any = None  #: float32 ``[num_experts, hidden]`` (the checkpoint's ``gate.weight``)
    experts: ExpertWeights | None = None

    def projections(self) -> list[QuantizedWeight]:
        """Every quantized weight of the layer (each expert's two)."""
        mlp = [self.gate_up, self.down] if self.experts is None else [*self.experts.w13, *self.experts.w2]
        return [w for w in (self.qkv, self.o, *mlp) if w is not None]


@dataclass
class ModelWeights:
    """Every weight of the model, on the backend (the embedding on the host for a host backend)."""

    embed: Any
    layers: list[LayerWeights]
    final_norm: Any
    lm_head: QuantizedWeight

    def nbytes(self) -> int:
        """Bytes of the weights past the embedding (projections in their format, norms, routers, the lm_head): what
        a decode step reads, except that it reads only the experts its tokens are routed to."""
        total = self.lm_head.nbytes + int(self.final_norm.nbytes)
        for layer in self.layers:
            total += sum(w.nbytes for w in layer.projections())
            total += sum(int(v.nbytes) for v in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm,
                                                  layer.router) if v is not None)
        return total

    def quantized_count(self) -> int:
        """How many quantized weights the model holds (the lm_head, each expert's two included)."""
        return 1 + sum(len(layer.projections()) for layer in self.layers)


def join_columns(weights: list[QuantizedWeight], name: str) -> QuantizedWeight:
    """One weight whose output columns are ``weights``' in order (same K, bits, groups; no act-order)."""
    first = weights[0]
    if len(weights) == 1:
        return first
    for w in weights[1:]:
        if (w.shape[0], w.bits, w.group_size) != (first.shape[0], first.bits, first.group_size):
            raise CheckpointError(f"{name}: its projections differ in K, bits or group size "
                                  f"({first.shape[0]}/{first.bits}/{first.group_size} and "
                                  f"{w.shape[0]}/{w.bits}/{w.group_size}); the engine joins them into one")
        if (w.zeros is None) != (first.zeros is None):
            raise CheckpointError(f"{name}: some projections store zero points and some do not")
    if any(w.g_idx is not None for w in weights):
        raise ConfigurationError(f"{KEY}.desc_act: act-order checkpoints are not run by the engine "
                                 f"({name}: each projection orders its rows differently)")
    joined: dict[str, Any] = {field: np.concatenate([np.asarray(getattr(w, field)) for w in weights], axis=1)
              for field in ("qweight", "scales", *(("zeros",) if first.zeros is not None else ()))}
    return replace(first, **joined, shape=(first.shape[0], sum(w.shape[1] for w in weights)))


#: Output columns quantized at a time: the float temporaries of one slice stay small (16 MiB of float32 rows at
#: K = 1024), so loading never holds a float copy of a whole projection or lm_head.
QUANTIZE_ROWS = 4096


def quantize_rows(rows: np.ndarray, what: str, *, bits: int, group_size: int) -> QuantizedWeight:
    """A checkpoint's ``[N, K]`` float rows quantized as the ``[K, N]`` weight, :data:`QUANTIZE_ROWS` output
    columns at a time (per-column codes: the slices join exactly); CheckpointError (``what`` holds NaN or
    infinity) before any slice is kept."""
    parts = []
    for start in range(0, rows.shape[0], QUANTIZE_ROWS):
        block = np.asarray(rows[start:start + QUANTIZE_ROWS], dtype=np.float32)
        if not np.isfinite(block).all():
            raise CheckpointError(f"{what} holds NaN or infinity")
        parts.append(quantize(block.T, bits=bits, group_size=group_size))
    return join_columns(parts, what)


def mlp_prefix(config: ModelConfig, layer: int) -> str:
    """Where layer ``layer``'s MLP or MoE block is stored."""
    if config.moe is not None and layer in config.moe.sparse_layers:
        return f"model.layers.{layer}.{MOE_LAYOUTS[config.raw['model_type']].block}"
    return f"model.layers.{layer}.mlp"


def expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The stored names of expert ``expert``'s gate, up and down projections in MoE layer ``layer``."""
    layout = MOE_LAYOUTS[config.raw["model_type"]]
    prefix = mlp_prefix(config, layer)
    return (layout.expert_layer(prefix, expert, 0), layout.expert_layer(prefix, expert, 1),
            layout.expert_layer(prefix, expert, 2))


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every projection's ``[out, in]`` float shape by layer name (``lm_head`` and every expert included)."""
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"lm_head": (c.vocab_size, h)}
    for n in range(c.num_layers):
        p = f"model.layers.{n}"
        shapes.update({f"{p}.self_attn.q_proj": (c.q_size, h), f"{p}.self_attn.k_proj": (c.kv_size, h),
                       f"{p}.self_attn.v_proj": (c.kv_size, h), f"{p}.self_attn.o_proj": (h, c.q_size)})
        if c.moe is not None and n in c.moe.sparse_layers:
            e = c.moe.intermediate_size
            for expert in range(c.moe.num_experts):
                gate, up, down = expert_names(c, n, expert)
                shapes.update({gate: (e, h), up: (e, h), down: (h, e)})
        else:
            shapes.update({f"{p}.mlp.gate_proj": (i, h), f"{p}.mlp.up_proj": (i, h), f"{p}.mlp.down_proj": (h, i)})
    return shapes


class _Projections:
    """Each projection as a host QuantizedWeight: a float one quantized, a stored one converted."""

    def __init__(self, tensors: Tensors, config: ModelConfig, bits: int, group_size: int, lm_head_bits: int) -> None:
        self.tensors, self.config = tensors, config
        self.bits, self.group_size, self.lm_head_bits = bits, group_size, lm_head_bits
        quant = config.raw.get(KEY)
        self.format: CheckpointFormat | None = checkpoint_format(quant) if quant else None
        if self.format is not None and self.format.method != "gptq":
            raise ConfigurationError(f"{KEY}.quant_method: {self.format.method!r} checkpoints are not run by the "
                                     "engine (GPTQ and float checkpoints are)")
        if self.format is not None and self.format.desc_act:
            raise ConfigurationError(f"{KEY}.desc_act: act-order checkpoints are not run by the engine")
        self.shapes = _expected_shapes(config)
        if config.tie_word_embeddings:
            self.shapes.pop("lm_head")
        self.stored = {name: self._check(name, shape) for name, shape in self.shapes.items()}
        at_load = [(name, shape[1], lm_head_bits if name == "lm_head" else bits)
                   for name, shape in self.shapes.items() if not self.stored[name]]
        if config.tie_word_embeddings:
            at_load.append(("lm_head (the tied embedding)", config.hidden_size, lm_head_bits))
        for name, k, layer_bits in at_load:
            if k % group_size:
                raise ArgumentError(f"argument 'group_size': {group_size} does not divide the {k} inputs of {name} "
                                    "(quantized at load)")
            if layer_bits == 4 and k % 8:
                raise ArgumentError(f"argument '{'lm_head_bits' if name.startswith('lm_head') else 'bits'}': int4 "
                                    f"packs 8 inputs a word; {name} has {k} inputs")

    def _check(self, name: str, shape: tuple[int, int]) -> bool:
        """Whether layer ``name`` is stored quantized; its tensors' headers checked (nothing read)."""
        if self.tensors.has(f"{name}.bias"):
            raise CheckpointError(f"{self.tensors.folder}: tensor {name + '.bias'!r}: biased projections are not "
                                  "run by the engine")
        if self.format is not None and self.tensors.has(f"{name}.qweight"):
            fmt = self.format.for_layer(name)
            if fmt.desc_act:
                raise ConfigurationError(f"{KEY}.dynamic: layer {name!r} is act-order (desc_act), which the engine "
                                         "does not run")
            for part, spec in fmt.layer_specs(name, shape[1], shape[0]).items():
                if part != "bias" and (part != "g_idx" or self.tensors.has(f"{name}.g_idx")):
                    self.tensors.check(f"{name}.{part}", spec.shape, spec.dtypes, spec.layout)
            return True
        self.tensors.check(f"{name}.weight", shape)
        return False

    def weight(self, name: str, bits: int | None = None) -> QuantizedWeight:
        if self.stored[name]:
            assert self.format is not None
            fmt = self.format.for_layer(name)
            parts = {part: self.tensors.get(f"{name}.{part}") for part in fmt.parts
                     if part != "g_idx" or self.tensors.has(f"{name}.g_idx")}
            weight = fmt.convert(name, parts)
            if weight.g_idx is not None and np.array_equal(np.asarray(weight.g_idx),
                                                           np.arange(weight.shape[0]) // weight.group_size):
                weight = replace(weight, g_idx=None)  # the trivial order GPTQ writers store: no act-order
            return weight
        return quantize_rows(self.tensors.get(f"{name}.weight"), f"{self.tensors.folder}: tensor "
                             f"{name + '.weight'!r}", bits=bits or self.bits, group_size=self.group_size)

    def joined(self, names: list[str], backend: Backend) -> QuantizedWeight:
        return join_columns([self.weight(n) for n in names], names[0]).map_arrays(backend.asarray)


def load_weights(folder: str | Path, config: ModelConfig, backend: Backend, *, dtype: np.dtype, bits: int,
                 group_size: int, lm_head_bits: int, progress: Callable[[str], None] | None = None) -> ModelWeights:
    """Read, check and quantize ``folder``'s weights for ``backend`` (``progress`` is told each layer's name).

    Every tensor's header is checked against ``config`` before any tensor is
    read; CheckpointError names the file and tensor.
    """
    tensors = Tensors(Path(folder))
    c = config
    h = c.hidden_size
    vectors = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(c.num_layers):
        vectors.update({f"model.layers.{n}.input_layernorm.weight": (h,),
                        f"model.layers.{n}.post_attention_layernorm.weight": (h,)})
        if c.qk_norm:
            vectors.update({f"model.layers.{n}.self_attn.{x}_norm.weight": (c.head_size,) for x in "qk"})
        if c.moe is not None and n in c.moe.sparse_layers:
            vectors[f"{mlp_prefix(c, n)}.gate.weight"] = (c.moe.num_experts, h)
    for name, shape in vectors.items():
        tensors.check(name, shape)
    projections = _Projections(tensors, c, bits, group_size, lm_head_bits)

    def vector(name: str) -> Any:
        values = np.ascontiguousarray(tensors.get(name), dtype=dtype)
        if not np.isfinite(values.astype(np.float32)).all():
            raise CheckpointError(f"{folder}: tensor {name!r} holds NaN or infinity")
        return backend.asarray(values)

    layers = []
    for n in range(c.num_layers):
        p = f"model.layers.{n}"
        if progress is not None:
            progress(f"layer {n + 1}/{c.num_layers}")
        layer = LayerWeights(
            attn_norm=vector(f"{p}.input_layernorm.weight"),
            qkv=projections.joined([f"{p}.self_attn.{x}_proj" for x in "qkv"], backend),
            o=projections.joined([f"{p}.self_attn.o_proj"], backend),
            mlp_norm=vector(f"{p}.post_attention_layernorm.weight"))
        if c.qk_norm:
            layer.q_norm, layer.k_norm = (vector(f"{p}.self_attn.{x}_norm.weight") for x in "qk")
        if c.moe is not None and n in c.moe.sparse_layers:
            router = np.asarray(tensors.get(f"{mlp_prefix(c, n)}.gate.weight"), dtype=np.float32)
            if not np.isfinite(router).all():
                raise CheckpointError(f"{folder}: tensor {mlp_prefix(c, n) + '.gate.weight'!r} holds NaN or infinity")
            layer.router = backend.asarray(np.ascontiguousarray(router))
            names = [expert_names(c, n, e) for e in range(c.moe.num_experts)]
            layer.experts = ExpertWeights(tuple(projections.joined([gate, up], backend) for gate, up, _ in names),
                                          tuple(projections.joined([down], backend) for _, _, down in names))
        else:
            layer.gate_up = projections.joined([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], backend)
            layer.down = projections.joined([f"{p}.mlp.down_proj"], backend)
        layers.append(layer)
        tensors.drop_pages()  # the layer's tensors are copied (joined, quantized, converted): the file's pages can go
    if progress is not None:
        progress("lm_head")
    embed = tensors.get("model.embed_tokens.weight")
    if c.tie_word_embeddings:
        head = quantize_rows(embed, f"{folder}: tensor 'model.embed_tokens.weight' (the tied lm_head)",
                             bits=lm_head_bits, group_size=group_size)
    else:
        head = projections.weight("lm_head", lm_head_bits)
    weights = ModelWeights(embed=embed if backend.is_host else backend.asarray(embed), layers=layers,
                           final_norm=vector("model.norm.weight"), lm_head=head.map_arrays(backend.asarray))
    tensors.drop_pages()  # on the host the embedding stays a view: the rows a step reads come back as it reads them
    return weights


def embedding_rows(weights: ModelWeights, ids: Any, dtype: np.dtype, backend: Backend) -> Any:
    """``weights.embed[ids]`` in ``dtype`` on the backend."""
    rows = weights.embed[ids]
    if backend.is_host:
        return np.ascontiguousarray(rows, dtype=dtype)
    return rows.astype(dtype)
