"""vLLM's CPU attention backend, served by hal: what ``CPU_ATTN`` resolves to once ``HAL_VLLM`` is on.

vLLM's CPU platform always picks its ``CPU_ATTN`` backend, so the plugin
overrides that name (:func:`hal_vllm._plugin.register`). The class keeps
everything of vLLM's CPU backend that shapes the cache and the scheduler
(its name, block sizes in multiples of 32, the ``LBHNC`` cache layout, the
KV update outside ``forward``) and replaces the kernels: the metadata
builder passes vLLM's common metadata through, and each layer runs hal's
``write_kv_cache`` and ``paged_attention`` on vLLM's cache tensor.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # type: ignore[import-not-found, unused-ignore]

from ._attention import HalAttentionImpl, HalAttentionMetadataBuilder

__all__ = ["HalCPUAttentionBackend"]


class HalCPUAttentionBackend(CPUAttentionBackend):  # type: ignore[misc, unused-ignore]
    """vLLM's ``CPU_ATTN`` slot with hal's ops; decoder attention only, caches in the model's dtype."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the serving hal backend's declaration decides (checked when a layer is built)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == "decoder"

    @staticmethod
    def get_impl_cls() -> type[HalAttentionImpl]:
        return HalAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HalAttentionMetadataBuilder]:
        return HalAttentionMetadataBuilder

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
