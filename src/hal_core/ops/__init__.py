"""Op declarations (arguments, validation, cost, float64 reference), coverage declarations and dispatch.

Each op is one :class:`OpSpec` subclass declaring its facts (:class:`Arg`, :class:`Output`,
:class:`Feature`, :class:`BenchCases`); :func:`register_op` makes it known to every backend's front
door (:class:`Ops`), to coverage, tuning, ``hal bench``, ``hal info --explain`` and ``torch.ops.hal``.
"""

from __future__ import annotations

from ._catalog import OPS, register_op, unregister_op
from ._coverage import OpCoverage, call_features
from ._declare import Arg, BenchCases, Dim, Feature, Output, Role
from ._device_features import device_features
from ._dispatch import BoundOp, DispatchEvent, Ops, OpStats
from ._registry import OpRegistry
from ._spec import OpCall, OpImpl, OpSpec, Runner
from .fused_moe import FusedMoe
from .gated_activation import GatedActivation
from .paged_attention import PagedAttention
from .paged_attention_options import AttentionOptions
from .quantized_gemm import QuantizedGemm
from .rms_norm import RmsNorm
from .rotary_embedding import RotaryEmbedding
from .sample import Sample
from .write_kv_cache import WriteKVCache

__all__ = [
    "OPS",
    "Arg",
    "AttentionOptions",
    "BenchCases",
    "BoundOp",
    "Dim",
    "DispatchEvent",
    "Feature",
    "FusedMoe",
    "GatedActivation",
    "OpCall",
    "OpCoverage",
    "OpImpl",
    "OpRegistry",
    "OpSpec",
    "OpStats",
    "Ops",
    "Output",
    "PagedAttention",
    "QuantizedGemm",
    "RmsNorm",
    "Role",
    "Runner",
    "Sample",
    "RotaryEmbedding",
    "WriteKVCache",
    "call_features",
    "device_features",
    "register_op",
    "unregister_op",
]

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) or (callable(_value) and hasattr(_value, "__code__")):  # classes, functions
        _value.__module__ = __name__
