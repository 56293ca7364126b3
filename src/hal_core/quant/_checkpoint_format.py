"""What a checkpoint's ``quantization_config`` says, and the tensors it implies for each layer.

:func:`checkpoint_format` reads the config into a :class:`CheckpointFormat`;
:meth:`CheckpointFormat.layer_specs` gives the shape and dtypes every stored
tensor of a ``K -> N`` linear layer must have, so that a checkpoint's headers
are checked before any tensor is read; :meth:`CheckpointFormat.convert` turns
one layer's tensors into hal's :class:`~hal_core.quant.QuantizedWeight`.
Every error is a :class:`~hal_core.CheckpointError` naming the config key or
the layer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .._errors import CheckpointError
from ._weight import QuantizedWeight
from .awq import from_awq
from .gptq import _OFFSETS as GPTQ_FORMATS
from .gptq import from_gptq

__all__ = ["FLOATS", "KEY", "CheckpointFormat", "TensorSpec", "checkpoint_format"]

log = logging.getLogger("hal")

KEY = "quantization_config"
#: Keys that choose transformers' kernels or fusions, which hal replaces; they do not change the stored tensors.
_RUNTIME_KEYS = ("backend", "use_exllama", "exllama_config", "do_fuse", "fuse_max_seq_len",
                 "disable_exllama", "kernel_switch_threshold")

#: safetensors dtype names (``safe_open(...).get_slice(key).get_dtype()``).
FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
_WORDS = frozenset({"I32", "U32"})
_SCALES = frozenset({"F16", "BF16", "F32"})
_INTEGERS = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})


@dataclass(frozen=True)
class TensorSpec:
    """The shape and safetensors dtypes one stored tensor of a layer must have; ``layout`` says why, for messages."""

    shape: tuple[int, ...]
    dtypes: frozenset[str]
    layout: str


@dataclass(frozen=True)
class CheckpointFormat:
    """What ``quantization_config`` says about the stored tensors (see :func:`checkpoint_format`)."""

    method: str            #: ``"gptq"`` or ``"awq"``
    bits: int              #: 4 or 8 (AWQ: 4)
    group_size: int        #: rows per group; -1 for one group over all of K
    desc_act: bool         #: GPTQ act-order: every layer must store ``g_idx``
    layout: str            #: GPTQ ``"gptq"`` (v1) or ``"gptq_v2"``; AWQ ``"gemm"``
    #: GPTQ's per-module rules (``dynamic``), in order: (regex, overrides), overrides None for a ``-:`` rule.
    dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...] | None], ...] = ()

    def for_layer(self, name: str) -> CheckpointFormat:
        """This format with the first ``dynamic`` rule matching layer ``name`` applied (``re.match``, as GPTQ
        readers do); ``CheckpointError`` when a ``-:`` rule says the layer is not quantized."""
        for pattern, overrides in self.dynamic:
            if re.match(pattern, name):
                if overrides is None:
                    raise CheckpointError(f"layer {name!r}: the checkpoint stores {name}.qweight, but "
                                          f"{KEY}.dynamic rule '-:{pattern}' says the layer is not quantized")
                return replace(self, dynamic=(), **dict(overrides))
        return self

    @property
    def parts(self) -> tuple[str, ...]:
        """The stored parts of a quantized layer this format reads (besides ``bias``)."""
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")

    def layer_specs(self, name: str, k: int, n: int) -> dict[str, TensorSpec]:
        """What each stored part of layer ``name`` (``k`` inputs, ``n`` outputs in the model) must be.

        ``CheckpointError`` when no checkpoint of this format can hold such a
        layer (``group_size`` does not divide K, or K or N is not a whole
        number of packed words).
        """
        per_word = 32 // self.bits
        g = k if self.group_size == -1 else self.group_size
        if g <= 0 or k % g:
            raise CheckpointError(f"layer {name!r}: {KEY}.group_size is {self.group_size}, which does not divide "
                                  f"the model's K={k} input features; hal needs groups that divide K")
        rows_per_word = per_word if self.method == "gptq" else 8  # AWQ: hal repacks its rows 8 per word
        for what, size, step in (("K", k, rows_per_word), ("N", n, per_word)):
            if size % step:
                raise CheckpointError(f"layer {name!r}: the model's {what}={size} is not a multiple of {step}, "
                                      f"so no {self.method.upper()} {self.bits}-bit checkpoint can store it")
        groups = f"[K/G, {{}}] with K={k}, N={n} and G={g} ({KEY}.group_size is {self.group_size})"
        if self.method == "gptq":
            specs = {"qweight": TensorSpec((k // per_word, n), _WORDS, f"[K/{per_word}, N] with K={k}, N={n}"),
                     "g_idx": TensorSpec((k,), _INTEGERS, f"[K] with K={k}")}
        else:
            specs = {"qweight": TensorSpec((k, n // 8), _WORDS, f"[K, N/8] with K={k}, N={n}")}
        specs["qzeros"] = TensorSpec((k // g, n // per_word), _WORDS, groups.format(f"N/{per_word}"))
        specs["scales"] = TensorSpec((k // g, n), _SCALES, groups.format("N"))
        specs["bias"] = TensorSpec((n,), FLOATS, f"[N] with N={n}")
        return specs

    def convert(self, name: str, tensors: Mapping[str, Any]) -> QuantizedWeight:
        """One layer's tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) in hal's format."""
        try:
            if self.method == "gptq":
                weight = from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                   bits=self.bits, checkpoint_format=self.layout)
            else:
                weight = from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"layer {name!r}: {exc}") from exc
        k = weight.shape[0]
        expected = k if self.group_size == -1 else self.group_size
        if weight.group_size != expected:
            raise CheckpointError(f"layer {name!r}: its scales hold {k // weight.group_size} groups of "
                                  f"{weight.group_size} rows, but {KEY}.group_size is {self.group_size} "
                                  f"(K={k}); hal needs groups that divide K")
        return weight


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{KEY}.{key}: expected an integer, got {value!r}")
    return value


def _as_name(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"{KEY}.{key}: expected a string, got {value!r}")
    return value.lower()


def checkpoint_format(config: Mapping[str, Any]) -> CheckpointFormat:
    """Read a ``quantization_config`` dict; ``CheckpointError`` (a ``ValueError``) names the key hal cannot run.

    GPTQ (``quant_method: "gptq"``): ``bits`` 4 or 8; ``group_size`` (-1:
    one group); ``desc_act`` (act-order: each layer's ``g_idx`` is then
    required); ``sym`` either way (zero points are read from ``qzeros``);
    ``checkpoint_format`` (or ``format``) ``"gptq"`` (v1) or ``"gptq_v2"``;
    ``dynamic``, per-module rules (``"+:regex"``: that layer's ``bits``,
    ``group_size``, ``desc_act``; ``"-:regex"``: the layer is float), applied
    by :meth:`CheckpointFormat.for_layer`;
    kernel-repacked formats (``marlin``, ``bitblas``, ...) are refused.
    AWQ (``quant_method: "awq"``): ``version`` (or ``format``) ``"gemm"``
    only (GEMV, GEMV-fast, Marlin and exllama layouts are refused),
    ``bits`` (``w_bit``) 4, ``zero_point`` true, ``group_size``
    (``q_group_size``). Keys that pick transformers' kernels (``backend``,
    ``use_exllama``, ``exllama_config``, ``do_fuse``, ...) have no meaning
    here: hal's kernels run the layers.
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{KEY}: expected a JSON object, got {type(config).__name__}")
    method = config.get("quant_method")
    if not isinstance(method, str) or method.lower() not in ("gptq", "awq"):
        raise CheckpointError(f"{KEY}.quant_method: hal loads 'gptq' and 'awq' checkpoints, got {method!r}")
    method = method.lower()
    ignored = sorted(k for k in _RUNTIME_KEYS if config.get(k) not in (None, False))
    if ignored:
        log.info("hal: %s.%s choose transformers' kernels; hal's kernels run the layers instead",
                 KEY, "/".join(ignored))
    bits = _as_int(_get(config, "bits", "w_bit", default=4), "bits")
    group_size = _as_int(_get(config, "group_size", "q_group_size", default=128), "group_size")
    if group_size != -1 and group_size <= 0:
        raise CheckpointError(f"{KEY}.group_size: expected a positive size or -1, got {group_size}")
    if method == "gptq":
        if bits not in (4, 8):
            raise CheckpointError(f"{KEY}.bits: hal runs 4- and 8-bit GPTQ weights, got {bits}")
        layout = _as_name(_get(config, "checkpoint_format", "format", default="gptq"), "checkpoint_format")
        if layout not in GPTQ_FORMATS:
            raise CheckpointError(f"{KEY}.checkpoint_format: hal reads the GPTQ layouts {sorted(GPTQ_FORMATS)}, "
                                  f"got {layout!r} (a kernel-specific repacking; convert the checkpoint back to "
                                  f"'gptq' with the tool that made it)")
        desc_act = config.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise CheckpointError(f"{KEY}.desc_act: expected true or false, got {desc_act!r}")
        return CheckpointFormat("gptq", bits, group_size, desc_act, layout, _dynamic(config.get("dynamic")))
    layout = _as_name(_get(config, "version", "format", default="gemm"), "version")
    if layout != "gemm":
        raise CheckpointError(f"{KEY}.version: hal reads AWQ's 'gemm' layout, got {layout!r} (GEMV, GEMV-fast, "
                              f"Marlin and exllama layouts pack the words differently)")
    if bits != 4:
        raise CheckpointError(f"{KEY}.bits: AWQ checkpoints hal reads are 4-bit, got {bits}")
    if config.get("dynamic"):
        raise CheckpointError(f"{KEY}.dynamic: per-module rules are a GPTQ key; AWQ checkpoints have none")
    if config.get("zero_point", True) is not True:
        raise CheckpointError(f"{KEY}.zero_point: AWQ's gemm layout stores zero points (zero_point=true), "
                              f"got {config.get('zero_point')!r}")
    return CheckpointFormat("awq", 4, group_size, False, "gemm")


def _dynamic(rules: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...] | None], ...]:
    """GPTQ's ``dynamic``: ``{"+:regex" or "regex": {bits, group_size, desc_act, sym}, "-:regex": {}}``, checked."""
    if rules is None:
        return ()
    if not isinstance(rules, Mapping):
        raise CheckpointError(f"{KEY}.dynamic: expected an object of module-name rules, got {rules!r}")
    parsed: list[tuple[str, tuple[tuple[str, Any], ...] | None]] = []
    for key, overrides in rules.items():
        pattern = key[2:] if key.startswith(("+:", "-:")) else key
        try:
            re.compile(pattern)
        except re.error as exc:
            raise CheckpointError(f"{KEY}.dynamic[{key!r}]: not a regular expression ({exc})") from None
        if key.startswith("-:"):
            parsed.append((pattern, None))
            continue
        if not isinstance(overrides, Mapping):
            raise CheckpointError(f"{KEY}.dynamic[{key!r}]: expected an object of overrides, got {overrides!r}")
        unknown = sorted(set(overrides) - {"bits", "group_size", "desc_act", "sym"})
        if unknown:
            raise CheckpointError(f"{KEY}.dynamic[{key!r}]: hal reads the overrides bits, group_size, desc_act "
                                  f"and sym, got {', '.join(map(repr, unknown))}")
        values: dict[str, Any] = {}
        if "bits" in overrides:
            values["bits"] = _as_int(overrides["bits"], f"dynamic[{key!r}].bits")
            if values["bits"] not in (4, 8):
                raise CheckpointError(f"{KEY}.dynamic[{key!r}].bits: hal runs 4- and 8-bit GPTQ weights, "
                                      f"got {values['bits']}")
        if "group_size" in overrides:
            values["group_size"] = _as_int(overrides["group_size"], f"dynamic[{key!r}].group_size")
            if values["group_size"] != -1 and values["group_size"] <= 0:
                raise CheckpointError(f"{KEY}.dynamic[{key!r}].group_size: expected a positive size or -1, "
                                      f"got {values['group_size']}")
        if "desc_act" in overrides:
            if not isinstance(overrides["desc_act"], bool):
                raise CheckpointError(f"{KEY}.dynamic[{key!r}].desc_act: expected true or false, "
                                      f"got {overrides['desc_act']!r}")
            values["desc_act"] = overrides["desc_act"]
        parsed.append((pattern, tuple(values.items())))  # sym: zero points are read from qzeros either way
    return tuple(parsed)
