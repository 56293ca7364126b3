"""hal's attention as vLLM's ``CUSTOM`` backend on CUDA and ROCm (``--attention-backend CUSTOM``).

The same implementation and metadata builder as on CPU
(:mod:`hal_vllm._attention`), on vLLM's per-layer ``LBHNC`` cache tensor of
the GPU; vLLM's selector asks :meth:`HalAttentionBackend.validate_configuration`
(the ``supports_*`` answers of :class:`~hal_vllm._attention.HalBackendTraits`)
before it picks it, and reports the reasons when it cannot. Attention runs outside vLLM's CUDA graphs
(``AttentionCGSupport.NEVER``, vLLM's default), on torch's current stream;
hal's ops on device tensors never synchronise or read device memory back.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import KVCacheLayout

from ._attention import HalBackendTraits

__all__ = ["HalAttentionBackend"]


class HalAttentionBackend(HalBackendTraits, AttentionBackend):  # type: ignore[misc, unused-ignore]
    """hal's ops as vLLM's ``CUSTOM`` attention backend."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
        return (KVCacheLayout.LBHNC,)
