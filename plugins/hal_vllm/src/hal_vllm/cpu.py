"""vLLM's CPU attention backend, served by hal: what ``CPU_ATTN`` resolves to once ``HAL_VLLM`` is on.

vLLM's CPU platform always picks its ``CPU_ATTN`` backend, so the plugin
overrides that name (:func:`hal_vllm._plugin.register`). The class keeps
what of vLLM's CPU backend shapes the cache and the scheduler (its name,
block sizes in multiples of 32, the ``LBHNC`` cache layout) and replaces the
kernels (:class:`~hal_vllm._attention.HalBackendTraits`): the metadata
builder passes vLLM's common metadata through, and each layer runs hal's
``write_kv_cache`` and ``paged_attention`` on vLLM's cache tensor.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from ._attention import HalBackendTraits

__all__ = ["HalCPUAttentionBackend"]


class HalCPUAttentionBackend(HalBackendTraits, CPUAttentionBackend):  # type: ignore[misc, unused-ignore]
    """vLLM's ``CPU_ATTN`` slot with hal's ops."""
