"""The GPU op implementations, shared by every CuPy platform, registered with a backend's op registry.

One op is two modules: ``_<op>.py`` (its ``supports`` rule and the device
function, as a :class:`GpuOp`) and ``_<op>_rules.py`` (its constants,
specialisations and pure launch rules), plus its kernel files in
``hal_cupy/kernels``. :data:`OPS` lists the ops; the catalogue of kernel
specialisations (:func:`all_specializations`) is gathered from them.
"""

from __future__ import annotations

from hal_core.ops import OpCoverage, OpRegistry

from .._specialization import Specialization
from . import (
    _fused_moe,
    _gated_activation,
    _paged_attention,
    _quantized_gemm,
    _rms_norm,
    _rotary_embedding,
    _sample,
    _write_kv_cache,
)
from ._common import GpuOp
from ._fused_moe_rules import MOE_BITS, MOE_GROUP_SIZES
from ._paged_attention_rules import PA_BLOCK_SIZES, PA_HEAD_SIZES

__all__ = ["FALLBACK_OPS", "OPS", "all_specializations", "register_ops"]

#: Every GPU op implementation.
OPS: tuple[GpuOp, ...] = (_paged_attention.OP, _write_kv_cache.OP, _quantized_gemm.OP, _sample.OP, _rms_norm.OP,
                          _gated_activation.OP, _rotary_embedding.OP, _fused_moe.OP)
#: hal ops without a GPU implementation yet, declared ``OpCoverage.none()``: every call runs on the host fallback.
FALLBACK_OPS: tuple[str, ...] = ()


def register_ops(registry: OpRegistry, backend: str, *, w4a8: bool = False) -> None:
    """Register every implementation for ``backend`` (named ``<backend>.<op>``, priority 100).

    Attention is declared for its kernels' head sizes and block sizes with every variant (prefill and mixed
    batches, sliding window, softcap, sinks, ALiBi, strided cache views). ``quantized_gemm`` is declared for
    W4A16 and W8A8, and W4A8 where ``w4a8`` (every device has the int8 tensor-core MMA,
    :func:`hal_cupy.ops._quantized_gemm.w4a8_everywhere`): elsewhere int4 weights with
    ``activations='int8'`` fall back and ``'auto'`` keeps them in float.
    ``fused_moe`` is declared for int4 and int8 experts of the kernels' group sizes (fp16 scales, no act-order),
    int4 ones with float or int8 activations (W4A16, W4A8: the grouped GEMMs' byte dot products run on every
    device; ``'auto'`` still picks W4A8 only where the device declares ``int8_dot``).
    The ops of :data:`FALLBACK_OPS` (none at present) are declared left to the fallback.
    """
    for op in OPS:
        registry.register(op.impl(backend))
    registry.declare("paged_attention", OpCoverage(
        head_sizes=PA_HEAD_SIZES, block_sizes=PA_BLOCK_SIZES,
        variants=("prefill", "window", "softcap", "sinks", "alibi", "strided_cache")))
    registry.declare("quantized_gemm", OpCoverage(schemes=("w4a16", "w8a8", "w4a8") if w4a8 else ("w4a16", "w8a8")))
    registry.declare("fused_moe", OpCoverage(bits=MOE_BITS, group_sizes=MOE_GROUP_SIZES,
                                             schemes=("w4a16", "w4a8", "w8a8")))
    for name in FALLBACK_OPS:
        registry.declare(name, OpCoverage.none())


def all_specializations(warp_size: int = 32) -> list[Specialization]:
    """Every specialisation the op implementations may request on a device of ``warp_size`` lanes, op by op.

    Entries with ``min_sm`` > 0 (the tensor-core kernels, 32-lane warps only) build only where the platform's
    :meth:`~hal_cupy.GpuPlatform.warp_mma_level` reaches ``min_sm``.
    """
    return [spec for op in OPS for spec in op.specializations(warp_size)]
