"""The GPU op implementations, shared by every CuPy platform, registered with a backend's op registry."""

from __future__ import annotations

from hal_core.ops import OpCoverage, OpRegistry

from . import _paged_attention, _quantized_gemm, _write_kv_cache
from ._common import GpuOp

__all__ = ["OPS", "register_ops"]

#: Every GPU op implementation.
OPS: tuple[GpuOp, ...] = (_paged_attention.OP, _write_kv_cache.OP, _quantized_gemm.OP)


def register_ops(registry: OpRegistry, backend: str) -> None:
    """Register every implementation for ``backend`` (named ``<backend>.<op>``, priority 100).

    Attention is declared for decode over C-contiguous caches (no ``variants``): prefill, sliding
    windows, softcap, sinks, ALiBi and strided cache views run on the CPU path.
    """
    for op in OPS:
        registry.register(op.impl(backend))
    registry.declare("paged_attention", OpCoverage(variants=()))
