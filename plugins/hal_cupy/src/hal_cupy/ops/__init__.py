"""The CUDA op implementations, registered with a backend's op registry."""

from __future__ import annotations

from hal_core.ops import OpRegistry

from . import _paged_attention, _quantized_gemm, _write_kv_cache
from ._common import CudaOp

__all__ = ["OPS", "register_ops"]

#: Every CUDA op implementation.
OPS: tuple[CudaOp, ...] = (_paged_attention.OP, _write_kv_cache.OP, _quantized_gemm.OP)


def register_ops(registry: OpRegistry) -> None:
    """Register every CUDA implementation (priority 100, above any generic one)."""
    for op in OPS:
        registry.register(op.impl())
