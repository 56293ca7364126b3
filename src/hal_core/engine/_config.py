"""The model an engine runs, read from a Hugging Face ``config.json``.

Architectures (``model_type``): ``llama`` and ``mistral`` (a sliding window
on every layer); ``qwen3`` (Llama's layer with an RMSNorm over each query
and key head before the rotary embedding); ``mixtral`` (Mistral's attention,
every MLP a sparse MoE block); ``qwen3_moe`` (Qwen3's attention, the MLPs of
the layers ``decoder_sparse_step`` and ``mlp_only_layers`` select sparse MoE
blocks, the others dense). A MoE block routes as transformers' does
(:class:`MoeConfig`) and runs as one ``fused_moe`` call.

Every field that changes the computation is either honoured or refused by
name: a feature the engine does not run (biases on the projections, an
unknown activation, another architecture) is a :class:`~hal_core.ConfigurationError`
naming the field, never ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError
from ..rope import RopeConfig, rope_config

__all__ = ["ACTIVATIONS", "MoeConfig", "ModelConfig"]

#: ``hidden_act`` values -> the ``gated_activation`` op's ``activation``.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
_ARCHITECTURES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe")
#: Architectures whose attention normalises each query and key head (``q_norm``, ``k_norm``).
_QK_NORM = ("qwen3", "qwen3_moe")
#: Architectures with sparse MoE blocks.
_MOE = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MoE blocks of a ``mixtral`` or ``qwen3_moe`` model, as ``fused_moe`` runs them."""

    num_experts: int
    top_k: int  #: ``num_experts_per_tok``
    intermediate_size: int  #: each expert's (``moe_intermediate_size``; Mixtral's ``intermediate_size``)
    routing: str  #: ``fused_moe``'s: Mixtral and ``norm_topk_prob`` renormalise the top-k probabilities
    sparse_layers: frozenset[int]  #: the layers whose MLP is a MoE block (the others are dense)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], model_type: str, num_layers: int) -> MoeConfig:
        """The MoE fields of ``config``; ConfigurationError names a refused one."""
        experts = _size(config, "num_experts" if config.get("num_experts") is not None else "num_local_experts")
        top_k = _size(config, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigurationError(f"config field 'num_experts_per_tok': {top_k} is more than the {experts} "
                                     "experts")
        if model_type == "mixtral":
            return cls(experts, top_k, _size(config, "intermediate_size"), "softmax_topk_renorm",
                       frozenset(range(num_layers)))
        step = _size(config, "decoder_sparse_step", 1)
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list | tuple) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                         for n in dense):
            raise ConfigurationError(f"config field 'mlp_only_layers': expected a list of layer indices, got "
                                     f"{dense!r}")
        sparse = frozenset(n for n in range(num_layers) if n not in dense and (n + 1) % step == 0)
        routing = "softmax_topk_renorm" if config.get("norm_topk_prob") else "softmax_topk"
        return cls(experts, top_k, _size(config, "moe_intermediate_size"), routing, sparse)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder the engine runs (the architectures of the module docs)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    activation: str  #: the ``gated_activation`` op's name for ``hidden_act``
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    rope: RopeConfig  #: the rotary embedding (its scaling type checked when the config is read)
    eos_token_ids: tuple[int, ...]  #: ``eos_token_id`` (null, an id or a list of ids)
    qk_norm: bool = False  #: an RMSNorm over each query and key head before the rotary embedding (Qwen3)
    moe: MoeConfig | None = None  #: the sparse MoE blocks (None: every MLP dense)
    #: the whole config (rotary fields are read from it)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read and check ``config`` (a ``config.json``'s contents); ConfigurationError names a refused field."""
        if not isinstance(config, Mapping):
            raise ConfigurationError(f"config: expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ConfigurationError(f"config field 'model_type': {model_type!r} is not run by the engine "
                                     f"(supported: {', '.join(_ARCHITECTURES)})")
        for name in ("attention_bias", "mlp_bias"):
            if config.get(name):
                raise ConfigurationError(f"config field {name!r}: biased projections are not run by the engine")
        act = config.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ConfigurationError(f"config field 'hidden_act': {act!r} is not one of {', '.join(ACTIVATIONS)}")
        hidden, heads = _size(config, "hidden_size"), _size(config, "num_attention_heads")
        kv_heads = _size(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigurationError(f"config field 'num_key_value_heads': {kv_heads} does not divide "
                                     f"num_attention_heads={heads}")
        eps = config.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ConfigurationError(f"config field 'rms_norm_eps': expected a finite number > 0, got {eps!r}")
        vocab, inter = _size(config, "vocab_size"), _size(config, "intermediate_size")
        layers, head_size = _size(config, "num_hidden_layers"), _size(config, "head_dim", hidden // heads)
        window = _window(config, model_type)
        positions = _size(config, "max_position_embeddings", 4096)
        try:
            rope = rope_config(config)
        except ConfigurationError as exc:
            raise ConfigurationError(f"config field {exc}") from None
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
                   num_kv_heads=kv_heads, head_size=head_size, rms_norm_eps=float(eps), activation=ACTIVATIONS[act],
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), sliding_window=window,
                   max_position_embeddings=positions,
                   rope=rope, eos_token_ids=_eos_ids(config.get("eos_token_id")), qk_norm=model_type in _QK_NORM,
                   moe=MoeConfig.from_dict(config, model_type, layers) if model_type in _MOE else None,
                   raw=dict(config))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigurationError(f"{file}: no config.json in the model folder")
        try:
            config = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigurationError(f"{file}: not JSON ({exc})") from None
        try:
            return cls.from_dict(config)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{file}: {exc}") from None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


def _size(config: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """Field ``name`` (``default`` when absent or null), an integer >= 1; ConfigurationError names it."""
    value = config.get(name)
    if value is None:
        if default is None:
            raise ConfigurationError(f"config field {name!r}: missing")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"config field {name!r}: expected an integer >= 1, got {value!r}")
    return value


def _window(config: Mapping[str, Any], model_type: str) -> int | None:
    """The sliding window every layer attends within (None: full attention), as transformers reads it;
    ConfigurationError for a model whose layers attend differently (Qwen3's ``use_sliding_window``, which windows
    only the layers from ``max_window_layers`` on)."""
    if model_type == "qwen3":
        if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or ()):
            raise ConfigurationError("config field 'use_sliding_window': a window on some layers only is not run by "
                                     "the engine")
        return None
    if model_type == "qwen3_moe" and not config.get("use_sliding_window"):
        return None
    return _size(config, "sliding_window") if config.get("sliding_window") else None


def _eos_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id`` (null, an id or a list of ids) as a tuple; ConfigurationError names the field."""
    values = () if value is None else tuple(value) if isinstance(value, list | tuple) else (value,)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigurationError(f"config field 'eos_token_id': expected a token id or a list of them, got {value!r}")
    return values
