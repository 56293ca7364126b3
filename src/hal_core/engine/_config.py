"""The model an engine runs, read from a Hugging Face ``config.json`` (Llama-architecture decoders).

Every field that changes the computation is either honoured or refused by
name: a feature the engine does not run (biases on the projections, an
unknown activation, another architecture) is a :class:`~hal_core.ConfigurationError`
naming the field, never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError

__all__ = ["ACTIVATIONS", "ModelConfig"]

#: ``hidden_act`` values -> the ``gated_activation`` op's ``activation``.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
_ARCHITECTURES = ("llama", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-architecture decoder (``model_type`` llama or mistral)."""

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
    raw: Mapping[str, Any] = field(repr=False, compare=False)  #: the whole config (rotary fields are read from it)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read and check ``config`` (a ``config.json``'s contents); ConfigurationError names a refused field."""
        model_type = config.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ConfigurationError(f"config field 'model_type': {model_type!r} is not run by the engine "
                                     f"(supported: {', '.join(_ARCHITECTURES)})")
        for name in ("attention_bias", "mlp_bias"):
            if config.get(name):
                raise ConfigurationError(f"config field {name!r}: biased projections are not run by the engine")
        act = config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ConfigurationError(f"config field 'hidden_act': {act!r} is not one of {', '.join(ACTIVATIONS)}")
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_size = int(config.get("head_dim") or hidden // heads)
            values = cls(
                vocab_size=int(config["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), activation=ACTIVATIONS[act],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                sliding_window=int(config["sliding_window"]) if config.get("sliding_window") else None,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)), raw=dict(config))
        except KeyError as exc:
            raise ConfigurationError(f"config field {exc.args[0]!r}: missing") from None
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"config: a size is not an integer ({exc})") from None
        if heads % kv_heads:
            raise ConfigurationError(f"config field 'num_key_value_heads': {kv_heads} does not divide "
                                     f"num_attention_heads={heads}")
        return values

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``."""
        file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except FileNotFoundError:
            raise ConfigurationError(f"{file}: no config.json in the model folder") from None
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{file}: not JSON ({exc})") from None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size
