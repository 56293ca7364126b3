"""What ``hal bench --model`` runs: the model's config (a built-in size or a Hugging Face config), the contenders,
and the bytes a decode step must read (no torch needed).

A model is a Llama-architecture config, or a Qwen3-MoE one (every MLP a
sparse MoE block, which hal's quantized transformers contenders run as
:class:`~hal_core.torch.QuantMoE` and the engine as one ``fused_moe`` call): a built-in size (:data:`BUILTIN_MODELS`)
or a path to a ``config.json`` (or a directory holding one) whose
``model_type`` is one of :data:`LLAMA_TYPES` or :data:`MOE_TYPES`. Its
weights are random (seeded): nothing is downloaded, and a checkpoint's own
weights are never read, only its config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._cases import BenchArgumentError

__all__ = ["BUILTIN_MODELS", "CONTENDERS", "LLAMA_TYPES", "MOE_TYPES", "Contender", "ModelSpec", "active_experts",
           "check_sizes", "decode_bytes", "decode_limit", "expert_shapes", "linear_shapes", "resolve_contenders",
           "resolve_model", "step_bytes"]

#: ``model_type`` values whose layers are Llama's (RMSNorm, rotary GQA attention, gated MLP, no biases needed).
LLAMA_TYPES = ("llama", "mistral")
#: ``model_type`` values of sparse MoE models: Llama's attention (with per-head q/k norms), every MLP a routed block
#: of ``num_experts`` gated experts of ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token.
MOE_TYPES = ("qwen3_moe",)

_COMMON = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "bos_token_id": 1, "eos_token_id": 2}

#: Built-in sizes. ``1b``: 1.7 GB of bf16 weights (hidden 2048, 16 layers, GQA 16/4 heads of 128, MLP 5632,
#: vocabulary 32000); ``tiny``: a few MB for tests (2 layers, GQA 2/1 heads of 128).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
             "max_position_embeddings": 2048, "initializer_range": 0.1},
    "1b": {**_COMMON, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
           "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
           "max_position_embeddings": 4096, "initializer_range": 0.02},
}
_MOE_COMMON = {**_COMMON, "model_type": "qwen3_moe", "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": []}
#: ``moe``: a Qwen3-MoE of 0.49 B parameters, 50 M of them experts active per token (hidden 1024, 8 layers, GQA
#: 16/4 heads of 64, 32 experts of 512, 4 per token, vocabulary 32000); ``tiny-moe``: a few MB for tests.
BUILTIN_MODELS.update({
    "moe": {**_MOE_COMMON, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048,
            "moe_intermediate_size": 512, "num_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
            "initializer_range": 0.02},
    "tiny-moe": {**_MOE_COMMON, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
                 "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                 "max_position_embeddings": 2048, "initializer_range": 0.1},
})

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
#: Keys of a checkpoint's config that describe its stored weights, not the architecture: dropped.
_DROPPED = ("quantization_config", "architectures", "auto_map", "_name_or_path", "transformers_version",
            "torch_dtype", "dtype")

_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: its name (a built-in size or the config's path) and its config as a dict."""

    name: str
    config: Mapping[str, Any]

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.heads)

    @property
    def head_size(self) -> int:
        return int(self.config.get("head_dim") or self.hidden // self.heads)

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def moe(self) -> bool:
        """Whether every MLP is a sparse MoE block (:data:`MOE_TYPES`)."""
        return self.config["model_type"] in MOE_TYPES

    @property
    def experts(self) -> int:
        return int(self.config.get("num_experts") or 0)

    @property
    def top_k(self) -> int:
        return int(self.config.get("num_experts_per_tok") or 0)

    @property
    def moe_intermediate(self) -> int:
        return int(self.config.get("moe_intermediate_size") or 0)

    def norm_weights(self) -> int:
        """Elements of every norm's weight: two per layer and the final one (and Qwen3's per-head q/k norms)."""
        return (2 * self.layers + 1) * self.hidden + (2 * self.layers * self.head_size if self.moe else 0)

    def parameters(self) -> int:
        """Parameters of the model (a tied embedding counted once; every expert and router)."""
        linear = sum(k * n for _, k, n in linear_shapes(self))
        experts = self.layers * self.experts * (3 * self.hidden * self.moe_intermediate + self.hidden)
        return linear + experts + self.norm_weights() + self.vocab * self.hidden * (1 if self.tied else 2)

    def summary(self) -> dict[str, Any]:
        """The figures a report shows: sizes, heads, parameters (and the experts of a MoE model)."""
        found = {"name": self.name, "layers": self.layers, "hidden": self.hidden,
                 "intermediate": int(self.config["intermediate_size"]), "heads": self.heads,
                 "kv_heads": self.kv_heads, "head_size": self.head_size, "vocab": self.vocab,
                 "tied_embeddings": self.tied, "parameters": self.parameters()}
        if self.moe:
            found.update(experts=self.experts, experts_per_token=self.top_k, moe_intermediate=self.moe_intermediate)
        return found


def resolve_model(text: str) -> ModelSpec:
    """A built-in size by name, or the config at a path (``config.json`` or a directory holding one).

    Raises :class:`BenchArgumentError` naming ``--model`` for an unknown
    name, a missing or unreadable file, or a config that is not a Llama
    architecture with the sizes this benchmark needs.
    """
    if text in BUILTIN_MODELS:
        return ModelSpec(text, dict(BUILTIN_MODELS[text]))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise BenchArgumentError(f"argument --model: {text!r} is neither a built-in size "
                                 f"({', '.join(BUILTIN_MODELS)}) nor a config.json or a directory holding one")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchArgumentError(f"argument --model: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise BenchArgumentError(f"argument --model: {path} holds no JSON object")
    text_config = config.get("text_config")
    known = LLAMA_TYPES + MOE_TYPES
    if config.get("model_type") not in known and isinstance(text_config, dict):
        config = text_config  # a multimodal model's language model
    kind = config.get("model_type")
    if kind not in known:
        raise BenchArgumentError(f"argument --model: {path}: model_type {kind!r} is not a Llama architecture "
                                 f"(expected one of {', '.join(known)})")
    required = _REQUIRED + (_MOE_REQUIRED if kind in MOE_TYPES else ())
    missing = [k for k in required if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)
               or config[k] <= 0]
    if missing:
        raise BenchArgumentError(f"argument --model: {path}: missing or not a positive integer: "
                                 f"{', '.join(missing)}")
    spec = ModelSpec(str(path), {k: v for k, v in config.items() if k not in _DROPPED})
    if spec.heads % spec.kv_heads:
        raise BenchArgumentError(f"argument --model: {path}: num_key_value_heads={spec.kv_heads} does not divide "
                                 f"num_attention_heads={spec.heads}")
    if spec.config.get("attention_bias") or spec.config.get("mlp_bias"):
        raise BenchArgumentError(f"argument --model: {path}: attention_bias / mlp_bias are not Llama's layers")
    if spec.moe and (spec.config.get("mlp_only_layers") or spec.config.get("decoder_sparse_step", 1) != 1
                     or spec.top_k > spec.experts):
        raise BenchArgumentError(f"argument --model: {path}: hal's MoE benchmark needs every layer a MoE block "
                                 f"(mlp_only_layers empty, decoder_sparse_step 1) and num_experts_per_tok <= "
                                 f"num_experts")
    return spec


# -- the contenders ---------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """One way to run the model: transformers' attention or hal's, float linears or hal's int4/int8, or hal's engine."""

    name: str
    #: ``"sdpa"`` (transformers' own, DynamicCache), ``"hal"`` (HalPagedCache) or ``"engine"`` (:mod:`hal_core.engine`,
    #: no torch: every op of the step on hal)
    attention: str
    dtype: str             #: the activations', KV cache's and float weights' dtype: ``"fp32"`` or ``"bf16"``
    bits: int | None       #: None: float linear layers; 4 or 8: hal's QuantLinear loaded from a GPTQ checkpoint
    description: str
    activations: str | None = None  #: the QuantLinear layers' ``activations`` (``"int8"``: W4A8)
    kernelize: bool = False  #: norms, gated activations and rotary on hal ops (:func:`hal_core.torch.kernelize`)
    #: The ``torch.compile`` backend the model's forward runs under (None: eager); compiled in an untimed round.
    compile: str | None = None

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


#: Every contender, in the order they run and print.
CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("sdpa-fp32", "sdpa", "fp32", None, "transformers, attn_implementation='sdpa', fp32"),
    Contender("sdpa-bf16", "sdpa", "bf16", None, "transformers, attn_implementation='sdpa', bf16"),
    Contender("hal-fp32", "hal", "fp32", None, "transformers with hal attention and paged cache, fp32"),
    Contender("hal-bf16", "hal", "bf16", None, "transformers with hal attention and paged cache, bf16"),
    Contender("hal-int4", "hal", "bf16", 4, "hal attention + hal int4 linears as load_quantized gives them "
              "(activations='auto': W4A16 for one row, W4A8 from two), bf16", "auto"),
    Contender("hal-int4-a16", "hal", "bf16", 4, "hal attention + hal W4A16 linears (the int4 checkpoint, "
              "activations='float'), bf16", "float"),
    Contender("hal-int8", "hal", "bf16", 8, "hal attention + hal W8A8 linears (GPTQ checkpoint), bf16"),
    Contender("hal-int4-a8", "hal", "bf16", 4, "hal attention + hal W4A8 linears (the int4 checkpoint, "
              "activations='int8'), bf16", "int8"),
    Contender("hal-int4-k", "hal", "bf16", 4, "hal-int4 with kernelize(): norms, MLP activation and rotary on hal "
              "ops, q/k/v and gate/up one GEMM each, bf16", "auto", kernelize=True),
    Contender("hal-int4-c", "hal", "bf16", 4, "hal-int4 with the model's forward under torch.compile (inductor), "
              "bf16", "auto", compile="inductor"),
    Contender("engine-int4", "engine", "bf16", 4, "hal_core.engine on the int4 checkpoint: every op of the step on "
              "hal, no torch, activations='auto' (its default), bf16", "auto"),
    Contender("engine-int4-a16", "engine", "bf16", 4, "engine-int4 with activations='float' (W4A16 projections), bf16",
              "float"),
    Contender("engine-int4-a8", "engine", "bf16", 4, "engine-int4 with activations='int8' (W4A8 projections), bf16",
              "int8"),
)}


def resolve_contenders(text: str | None) -> tuple[Contender, ...]:
    """Comma-separated contender names (None or ``all``: every one), in :data:`CONTENDERS` order."""
    if text is None or text.strip() == "all":
        return tuple(CONTENDERS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise BenchArgumentError(f"argument --contenders: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                                 f"known: {', '.join(CONTENDERS)} (or all)")
    return tuple(c for c in CONTENDERS.values() if c.name in names)


# -- the bytes a decode step reads --------------------------------------------------


def linear_shapes(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of every linear layer of the decoder layers (not ``lm_head``; of a MoE
    model, the attention's: its experts are :func:`expert_shapes`)."""
    h, i, d = spec.hidden, int(spec.config["intermediate_size"]), spec.head_size
    one = [("q_proj", h, spec.heads * d), ("k_proj", h, spec.kv_heads * d), ("v_proj", h, spec.kv_heads * d),
           ("o_proj", spec.heads * d, h)]
    if not spec.moe:
        one += [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
    return [(f"model.layers.{n}.{name}", k, m) for n in range(spec.layers) for name, k, m in one]


def expert_shapes(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of one expert's gate, up and down projections (none for a dense
    model)."""
    h, i = spec.hidden, spec.moe_intermediate
    return [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)] if spec.moe else []


def active_experts(spec: ModelSpec, batch: int) -> float:
    """Experts of one MoE layer a decode step of ``batch`` tokens reads, expected for a router that picks each
    token's ``top_k`` experts uniformly at random: ``E * (1 - (1 - top_k / E) ** batch)``."""
    if not spec.moe:
        return 0.0
    return spec.experts * (1.0 - (1.0 - spec.top_k / spec.experts) ** batch)


def _linear_bytes(k: int, n: int, contender: Contender, group_size: int) -> int:
    if contender.bits is None:
        return k * n * contender.dtype_bytes
    scales = (k // group_size) * n * 2  # float16 scales; symmetric: no zero points
    return k * n * contender.bits // 8 + scales


#: How a quantized contender holds ``lm_head``: int8 (W8A8), as ``quantize_model`` does by default.
_INT8 = Contender("lm_head", "hal", "bf16", 8, "the int8 lm_head of a quantized contender")


def step_bytes(spec: ModelSpec, contender: Contender, batch: int, context: int, group_size: int = 128) -> int:
    """Bytes one decode step of ``batch`` sequences, each attending over ``context`` positions, must read.

    Every weight once (the decoder's linear layers in the contender's format,
    the norms in its dtype, ``lm_head`` in int8 for a quantized contender --
    as ``quantize_model`` leaves it, unless tied to the embedding -- else in
    its dtype), each sequence's embedding row,
    and each sequence's keys and values of every layer over its context, in
    the contender's dtype. A MoE model reads every router (float) and, per
    layer, the experts its tokens are routed to (:func:`active_experts`, in
    the contender's format). What the step writes (one new key and value per
    layer, the logits) is left out: it is small against the reads.
    """
    size = contender.dtype_bytes
    weights = sum(_linear_bytes(k, n, contender, group_size) for _, k, n in linear_shapes(spec))
    quantized_head = contender.bits is not None and not spec.tied
    head = _linear_bytes(spec.hidden, spec.vocab, _INT8 if quantized_head else contender, group_size)
    weights += head + spec.norm_weights() * size
    if spec.moe:
        expert = sum(_linear_bytes(k, n, contender, group_size) for _, k, n in expert_shapes(spec))
        weights += spec.layers * (round(active_experts(spec, batch) * expert) + spec.experts * spec.hidden * size)
    kv = 2 * spec.layers * spec.kv_heads * spec.head_size * size * context
    return weights + batch * (spec.hidden * size + kv)


def decode_bytes(spec: ModelSpec, contender: Contender, batch: int, prompt_len: int, new_tokens: int,
                 group_size: int = 128) -> int:
    """Bytes of ``new_tokens`` decode steps after a ``prompt_len`` prefill: step ``i`` (1-based) attends over
    ``prompt_len + i`` positions (the prompt, the tokens decoded before it and its own)."""
    return sum(step_bytes(spec, contender, batch, prompt_len + i, group_size) for i in range(1, new_tokens + 1))


def decode_limit(spec: ModelSpec, contender: Contender, batch: int, prompt_len: int, new_tokens: int,
                 copy_gbps: float, group_size: int = 128) -> float:
    """Tokens/s if every decode step only read its bytes (:func:`decode_bytes`) at the copy bandwidth."""
    seconds = decode_bytes(spec, contender, batch, prompt_len, new_tokens, group_size) / (copy_gbps * 1e9)
    return batch * new_tokens / seconds


def check_sizes(spec: ModelSpec, contenders: Sequence[Contender], group_size: int) -> None:
    """Refuse (naming the option) a model whose linear layers the quantized contenders cannot hold."""
    if not any(c.bits for c in contenders):
        return
    for name, k, _ in linear_shapes(spec)[:4 if spec.moe else 7] + expert_shapes(spec):
        if k % group_size or k % 8:
            raise BenchArgumentError(f"argument --group-size: {name.split('.')[-1]} has {k} input features, "
                                     f"which {group_size} (and 8, int4's packing) must divide")
