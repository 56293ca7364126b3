"""vLLM's attention through hal: the metadata, its builder and the implementation both platforms share.

Each step vLLM builds one :class:`HalAttentionMetadata` per KV-cache group
from its common metadata (query start locations, sequence lengths including
this step's tokens, block table, slot mapping, and the host ints
``max_query_len`` / ``max_seq_len``), unchanged: no copy, no host read of a
device tensor. Each layer then calls :meth:`HalAttentionImpl.do_kv_cache_update`
(hal's ``write_kv_cache``) and :meth:`HalAttentionImpl.forward` (hal's
variable-length ``paged_attention``) on vLLM's own per-layer cache tensor.

That tensor is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(vLLM's ``LBHNC`` layout); :func:`split_kv_cache` views it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and takes the first
and second ``block_size`` rows of each block as K and V: two disjoint
strided views, which hal reads and writes in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (  # type: ignore[import-not-found, unused-ignore]
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)

from ._startup import LayerPlan, check_cache_spec, plan_layer

__all__ = ["HalAttentionImpl", "HalAttentionMetadata", "HalAttentionMetadataBuilder", "split_kv_cache"]


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V halves of a vLLM per-layer cache, each ``[num_blocks, num_kv_heads, block_size, head_size]``.

    Views, never copies: within each (block, KV head) the first ``block_size``
    rows of ``head_size`` elements are keys, the next ``block_size`` values
    (the split vLLM's own CPU backend uses).
    """
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, width // 2)
    return halves[:, :, :block_size], halves[:, :, block_size:]


@dataclass
class HalAttentionMetadata:
    """One step's attention inputs, as vLLM made them (device tensors; host ints as planning hints)."""

    num_actual_tokens: int  #: tokens of real requests (the query may have padding rows after them)
    max_query_len: int  #: >= every request's new tokens this step
    max_seq_len: int  #: >= every request's context length, new tokens included
    query_start_loc: torch.Tensor  #: int32 [num_reqs + 1]
    seq_lens: torch.Tensor  #: int32 [num_reqs]
    block_table: torch.Tensor  #: int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  #: int64 [num_tokens], -1 for padding


class HalAttentionMetadataBuilder(AttentionMetadataBuilder[HalAttentionMetadata]):  # type: ignore[misc, unused-ignore]
    """Passes vLLM's common metadata through; checks the group's cache spec once, at start-up."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_cache_spec(kv_cache_spec, vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> HalAttentionMetadata:
        common = common_attn_metadata
        if common.causal is not True:
            raise ValueError(
                "hal-vllm: hal's paged_attention is causal; this batch asks for non-causal attention "
                "(unset HAL_VLLM for this model)"
            )
        num_reqs = common.num_reqs
        return HalAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc[: num_reqs + 1],
            seq_lens=common.seq_lens[:num_reqs],
            block_table=common.block_table_tensor[:num_reqs],
            slot_mapping=common.slot_mapping,
        )


class HalAttentionImpl(AttentionImpl):  # type: ignore[misc, unused-ignore]
    """One vLLM attention layer on hal's ops; refuses at construction what hal cannot run exactly."""

    #: What vLLM's layer may pass beyond the standard arguments, and hal honours.
    extra_arguments: ClassVar[tuple[str, ...]] = ("sinks",)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sinks = sinks
        self.plan: LayerPlan = plan_layer(
            num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=self.num_kv_heads,
            alibi_slopes=alibi_slopes, sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap, attn_type=attn_type, has_sinks=sinks is not None,
            unsupported=sorted(unsupported), dtype=torch.get_default_dtype(),
        )
        self.scale = self.plan.scale
        self.sliding_window = self.plan.window

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """hal's ``write_kv_cache`` of this step's keys and values (slot -1: padding, skipped)."""
        key_cache, value_cache = split_kv_cache(kv_cache)
        num_tokens = slot_mapping.shape[0]
        with self.plan.on_stream(key):
            self.plan.ops.write_kv_cache(key[:num_tokens], value[:num_tokens], key_cache, value_cache, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HalAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hal's ``paged_attention`` of the step's new tokens into ``output`` ``[num_tokens, num_heads, head_size]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("hal-vllm does not fuse output quantization into attention")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs: no cache, no metadata
            return output
        meta = attn_metadata
        num_tokens = meta.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache)
        with self.plan.on_stream(query):
            self.plan.ops.paged_attention(
                query[:num_tokens], key_cache, value_cache, meta.block_table, meta.seq_lens,
                scale=self.plan.scale, query_start_loc=meta.query_start_loc, max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len, out=output[:num_tokens], **self.plan.features(self.sinks),
            )
        return output
