"""The CPU implementations of hal's ops, registered with :func:`register_ops`.

One module per op, named like hal_core's op modules. Each is a thin wrapper
around a compiled kernel (``hal_cpu._native``, sources in ``csrc/``); the
tunables' built-in choices live in :mod:`._rules`, and :mod:`._knobs` exposes them to ``hal tune``. The ``_fallback_*``
modules are numpy versions used only when the compiled library cannot be
loaded (logged once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hal_core.ops import OpCoverage

from . import (
    _knobs,
    fused_moe,
    gated_activation,
    paged_attention,
    quantized_gemm,
    rms_norm,
    rotary_embedding,
    sample,
    write_kv_cache,
)

if TYPE_CHECKING:
    from hal_core.ops import OpRegistry

__all__ = ["fused_moe", "gated_activation", "paged_attention", "quantized_gemm", "register_ops", "rms_norm",
           "rotary_embedding", "sample", "write_kv_cache"]


def register_ops(registry: OpRegistry) -> None:
    """Register the implementation of every op (priority 0; they support every valid call: attention runs
    prompts, chunks and decode rows with every variable-length option over any cache layout)."""
    registry.register("paged_attention", paged_attention.paged_attention, name="cpu.paged_attention",
                      knobs=(_knobs.PARTITION_TOKENS,), plan=paged_attention.plan_paged_attention)
    registry.register("write_kv_cache", write_kv_cache.write_kv_cache, name="cpu.write_kv_cache",
                      plan=write_kv_cache.plan_write_kv_cache)
    registry.register("quantized_gemm", quantized_gemm.quantized_gemm, name="cpu.quantized_gemm",
                      knobs=(_knobs.GEMM_KERNEL,), plan=quantized_gemm.plan_quantized_gemm)
    registry.declare("quantized_gemm", OpCoverage(schemes=("w4a16", "w4a8", "w8a8")))
    registry.register("sample", sample.sample, name="cpu.sample", plan=sample.plan_sample)
    registry.register("rms_norm", rms_norm.rms_norm, name="cpu.rms_norm", plan=rms_norm.plan_rms_norm)
    registry.register("gated_activation", gated_activation.gated_activation, name="cpu.gated_activation",
                      plan=gated_activation.plan_gated_activation)
    registry.register("rotary_embedding", rotary_embedding.rotary_embedding, name="cpu.rotary_embedding",
                      plan=rotary_embedding.plan_rotary_embedding)
    registry.declare("fused_moe", OpCoverage(schemes=("w4a16", "w4a8", "w8a8")))
    registry.register("fused_moe", fused_moe.fused_moe, name="cpu.fused_moe")
