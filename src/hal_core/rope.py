"""Rotary position embedding tables: the ``cos_sin_cache`` that :class:`~hal_core.ops.RotaryEmbedding` reads.

A table is ``[max_position, rotary_dim]`` float32: row ``p`` holds ``cos(p * inv_freq)`` in its first
``rotary_dim / 2`` columns and ``sin(p * inv_freq)`` in the second half (vLLM's layout), each times the
scaling type's attention factor (1 but for ``yarn``). Frequencies and angles are computed in float64 and
rounded to float32 once, so a table is at least as accurate as the float32 tables transformers and vLLM build.

The scaling types are those transformers' Llama, Qwen and Mistral configurations use (the keys are
transformers'):

======== ====================================================================================================
type     parameters
======== ====================================================================================================
default  ``rope_theta``
linear   ``factor``: every frequency divided by it (positions interpolated)
dynamic  ``factor``, ``max_position_embeddings``: NTK-aware, ``theta`` raised to
         ``theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))`` for the table's
         length ``L = max(max_position, max_position_embeddings)``
llama3   ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``
yarn     ``factor`` (default ``max_position_embeddings / original_max_position_embeddings``),
         ``original_max_position_embeddings``, optional ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``,
         ``mscale_all_dim``, ``attention_factor``, ``truncate`` (True); the attention factor multiplies cos and
         sin (transformers' ``attention_scaling``, vLLM's ``mscale``)
======== ====================================================================================================

Any other type is a :class:`~hal_core.ConfigurationError` naming it, never a silent default.

``dynamic`` and transformers: transformers recomputes the frequencies in the forward pass, for the longest
sequence seen so far (and back to the unscaled ones below ``max_position_embeddings``), so its angles depend
on the batch. A table here is computed once for its own length, as vLLM's dynamic NTK rotary embedding is: it
equals transformers' frequencies for a sequence of exactly ``max_position`` tokens, and is the unscaled table
when ``max_position <= max_position_embeddings``. Build it with ``max_position`` the longest sequence the
engine serves.

:func:`rope_config` reads a transformers-style configuration (an object or a dict): ``rope_parameters``
(transformers 5) or ``rope_theta`` with ``rope_scaling`` (earlier versions), ``partial_rotary_factor``,
``head_dim`` (else ``hidden_size // num_attention_heads``), ``max_position_embeddings`` and
``original_max_position_embeddings``. Importing this module imports numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import ConfigurationError

__all__ = ["ROPE_TYPES", "RopeConfig", "rope_config", "rope_cos_sin_cache", "rope_inv_freq"]

#: The scaling types hal computes tables for.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, rope_type: str = "default",
                  params: Mapping[str, Any] | None = None, *, max_position: int | None = None,
                  max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq float64 [rotary_dim / 2], attention_factor)`` of one scaling type.

    ``params`` holds the type's parameters under transformers' keys (see the module docstring);
    ``max_position`` is the table's length (``dynamic`` only) and ``max_position_embeddings`` the model's
    (``dynamic``, and ``yarn`` without a ``factor``). Raises :class:`~hal_core.ConfigurationError` naming a
    missing or bad parameter, or an unknown type.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 \
            or rotary_dim % 2:
        raise ConfigurationError(f"rotary_dim: expected an even int >= 2, got {rotary_dim!r}")
    theta = _positive("rope_theta", theta)
    params = dict(params or {})
    dim = int(rotary_dim)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / theta ** exponents
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / _positive("factor", _need(params, "factor", rope_type)), 1.0
    if rope_type == "dynamic":
        return _dynamic(dim, theta, exponents, params, max_position, max_position_embeddings), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(dim, theta, inv_freq, params, max_position_embeddings)
    raise ConfigurationError(f"rope type {rope_type!r} is not one hal computes (it computes "
                             f"{', '.join(ROPE_TYPES)}); its frequencies would be wrong, so it is refused")


def rope_cos_sin_cache(rotary_dim: int, max_position: int, theta: float = 10000.0, rope_type: str = "default",
                       params: Mapping[str, Any] | None = None, *,
                       max_position_embeddings: int | None = None) -> np.ndarray:
    """The ``[max_position, rotary_dim]`` float32 table: cos in the first half, sin in the second.

    Arguments as :func:`rope_inv_freq`; the attention factor multiplies both halves.
    """
    if isinstance(max_position, bool) or not isinstance(max_position, (int, np.integer)) or max_position < 1:
        raise ConfigurationError(f"max_position: expected an int >= 1, got {max_position!r}")
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, theta, rope_type, params, max_position=int(max_position),
                                               max_position_embeddings=max_position_embeddings)
    angles = np.arange(int(max_position), dtype=np.float64)[:, None] * inv_freq[None, :]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * attention_factor
    return table.astype(np.float32)


@dataclass(frozen=True)
class RopeConfig:
    """A model's rotary embedding, as :func:`rope_config` reads it from its configuration."""

    head_size: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    #: The type's parameters (transformers' keys), ``rope_type`` and ``rope_theta`` left out.
    params: Mapping[str, Any] = field(default_factory=dict)
    max_position_embeddings: int | None = None

    def inv_freq(self, max_position: int | None = None) -> tuple[np.ndarray, float]:
        """``(inv_freq float64 [rotary_dim / 2], attention_factor)`` (``max_position``: the table's length)."""
        return rope_inv_freq(self.rotary_dim, self.theta, self.rope_type, self.params, max_position=max_position,
                             max_position_embeddings=self.max_position_embeddings)

    def cos_sin_cache(self, max_position: int | None = None) -> np.ndarray:
        """The ``[max_position, rotary_dim]`` float32 table (default length: ``max_position_embeddings``)."""
        length = max_position if max_position is not None else self.max_position_embeddings
        if length is None:
            raise ConfigurationError("max_position: the configuration has no max_position_embeddings; pass one")
        return rope_cos_sin_cache(self.rotary_dim, length, self.theta, self.rope_type, self.params,
                                  max_position_embeddings=self.max_position_embeddings)


def rope_config(config: Any) -> RopeConfig:
    """The :class:`RopeConfig` of a transformers-style configuration (an object with attributes, or a dict).

    Reads ``rope_parameters`` (transformers 5), else ``rope_scaling`` (its ``rope_type`` or legacy ``type``) with
    ``rope_theta``; ``partial_rotary_factor`` (top level or in those); ``head_dim``, else
    ``hidden_size // num_attention_heads``; ``max_position_embeddings``; ``original_max_position_embeddings`` at
    the top level wins over the one in the parameters (Phi-3's convention, as transformers). Errors name the key.
    """
    get = (lambda key: config.get(key)) if isinstance(config, Mapping) else (lambda key: getattr(config, key, None))
    scaling = get("rope_parameters")
    key = "rope_parameters"
    if not scaling:
        scaling, key = get("rope_scaling"), "rope_scaling"
    scaling = dict(scaling or {})
    if scaling and all(isinstance(v, Mapping) for v in scaling.values()):
        raise ConfigurationError(f"{key}: per-layer-type rope parameters ({', '.join(map(str, scaling))}); "
                                 "read one layer type's with rope_config({**config, key: that dict})")
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if not isinstance(rope_type, str):
        raise ConfigurationError(f"{key}['rope_type']: expected a string, got {rope_type!r}")
    if rope_type not in ROPE_TYPES:
        raise ConfigurationError(f"{key}['rope_type'] = {rope_type!r}: hal computes rope tables for "
                                 f"{', '.join(ROPE_TYPES)} only")
    theta = scaling.pop("rope_theta", None)
    theta = get("rope_theta") if theta is None else theta
    theta = _positive(f"{key}['rope_theta']" if theta is not None else "rope_theta",
                      10000.0 if theta is None else theta)
    head_size = get("head_dim")
    if head_size is None:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
            raise ConfigurationError("head_dim: the configuration has neither head_dim nor hidden_size and "
                                     "num_attention_heads")
        head_size = hidden // heads
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 2:
        raise ConfigurationError(f"head_dim: expected an int >= 2, got {head_size!r}")
    partial = scaling.pop("partial_rotary_factor", None)
    partial = get("partial_rotary_factor") if partial is None else partial
    partial = 1.0 if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ConfigurationError(f"partial_rotary_factor: expected a number in (0, 1], got {partial!r}")
    rotary_dim = int(head_size * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigurationError(f"partial_rotary_factor: head_dim {head_size} * {partial} = {rotary_dim} rotary "
                                 "dimensions; expected an even number >= 2")
    max_positions = get("max_position_embeddings")
    if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)
                                      or max_positions < 1):
        raise ConfigurationError(f"max_position_embeddings: expected an int >= 1, got {max_positions!r}")
    if rope_type in ("llama3", "yarn"):
        original = get("original_max_position_embeddings")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        elif "original_max_position_embeddings" not in scaling and max_positions is not None:
            scaling["original_max_position_embeddings"] = max_positions
    config_out = RopeConfig(head_size, rotary_dim, theta, rope_type, scaling, max_positions)
    config_out.inv_freq()  # a missing or bad parameter is refused here, naming it
    return config_out


# -- the scaling types ----------------------------------------------------------------------------------------


def _need(params: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ConfigurationError(f"rope parameter {key!r}: required by rope type {rope_type!r}")
    return params[key]


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(value)) or float(value) <= 0:
        raise ConfigurationError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def _dynamic(dim: int, theta: float, exponents: np.ndarray, params: Mapping[str, Any], max_position: int | None,
             max_position_embeddings: int | None) -> np.ndarray:
    factor = _positive("factor", _need(params, "factor", "dynamic"))
    if max_position_embeddings is None:
        raise ConfigurationError("max_position_embeddings: required by rope type 'dynamic'")
    if dim <= 2:
        raise ConfigurationError(f"rotary_dim: rope type 'dynamic' needs more than 2 dimensions, got {dim}")
    length = max(max_position or max_position_embeddings, max_position_embeddings)
    base = theta * (factor * length / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** exponents


def _llama3(inv_freq: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    factor = _positive("factor", _need(params, "factor", "llama3"))
    low = _positive("low_freq_factor", _need(params, "low_freq_factor", "llama3"))
    high = _positive("high_freq_factor", _need(params, "high_freq_factor", "llama3"))
    old_len = _positive("original_max_position_embeddings", _need(params, "original_max_position_embeddings", "llama3"))
    if high <= low:
        raise ConfigurationError(f"high_freq_factor: expected more than low_freq_factor {low}, got {high}")
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, inv_freq: np.ndarray, params: Mapping[str, Any],
          max_position_embeddings: int | None) -> tuple[np.ndarray, float]:
    original = _positive("original_max_position_embeddings",
                         _need(params, "original_max_position_embeddings", "yarn"))
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ConfigurationError("rope parameter 'factor': required by rope type 'yarn' (or "
                                     "max_position_embeddings to derive it)")
        factor = max_position_embeddings / original
    factor = _positive("factor", factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    attention = _positive("attention_factor", attention)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(_positive("beta_fast", beta_fast)), correction_dim(_positive("beta_slow", beta_slow))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return inv_freq / factor * (1.0 - extrapolation) + inv_freq * extrapolation, attention
