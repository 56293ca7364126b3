"""Op definitions (signature, validation, cost, float64 reference) and dispatch."""

from __future__ import annotations

from ._dispatch import OPS, Ops
from ._registry import OpRegistry
from ._spec import OpCall, OpImpl, OpSpec
from .paged_attention import PagedAttention
from .quantized_gemm import QuantizedGemm
from .write_kv_cache import WriteKVCache

__all__ = ["OPS", "OpCall", "OpImpl", "OpRegistry", "OpSpec", "Ops", "PagedAttention", "QuantizedGemm", "WriteKVCache"]
