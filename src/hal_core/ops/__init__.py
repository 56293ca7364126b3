"""Op definitions (signature, validation, cost, float64 reference), coverage declarations and dispatch."""

from __future__ import annotations

from ._coverage import OpCoverage, call_features
from ._dispatch import OPS, DispatchEvent, Ops, OpStats
from ._registry import OpRegistry
from ._spec import OpCall, OpImpl, OpSpec
from .paged_attention import PagedAttention
from .quantized_gemm import QuantizedGemm
from .write_kv_cache import WriteKVCache

__all__ = [
    "OPS",
    "DispatchEvent",
    "OpCall",
    "OpCoverage",
    "OpImpl",
    "OpRegistry",
    "OpSpec",
    "OpStats",
    "Ops",
    "PagedAttention",
    "QuantizedGemm",
    "WriteKVCache",
    "call_features",
]

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) or callable(_value):
        _value.__module__ = __name__
