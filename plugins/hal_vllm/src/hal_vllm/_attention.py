"""vLLM's attention through hal: the metadata, its builder and the implementation both platforms share.

Each step vLLM builds one :class:`HalAttentionMetadata` per KV-cache
group from its common metadata (query start locations, sequence lengths
including this step's tokens, block table, and the host ints
``max_query_len`` / ``max_seq_len``), unchanged: each tensor is viewed once
as an array of the serving hal backend (numpy on CPU; no copy, no host read
of a device tensor), so the layers' calls skip that conversion. Each layer
then calls :meth:`HalAttentionImpl.do_kv_cache_update` (hal's
``write_kv_cache``) and :meth:`HalAttentionImpl.forward` (hal's
variable-length ``paged_attention``) on vLLM's own per-layer cache tensor,
whose K and V views it keeps for as long as vLLM keeps that tensor, with
both ops bound to them and to the layer's options (``Ops.bind``: a step's
calls of a layer then run the backend's planned runners).

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
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)

from hal_core import AttentionOptions
from hal_core.ops import BoundOp

from ._startup import LayerPlan, Route, check_cache_spec, plan_layer, serving_backend

__all__ = ["HalAttentionImpl", "HalAttentionMetadata", "HalAttentionMetadataBuilder", "HalBackendTraits",
           "split_kv_cache"]


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
    """One step's attention inputs as vLLM made them, as the serving backend's arrays (host ints as hints)."""

    num_actual_tokens: int  #: tokens of real requests (the query may have padding rows after them)
    max_query_len: int  #: >= every request's new tokens this step
    max_seq_len: int  #: >= every request's context length, new tokens included
    query_start_loc: Any  #: int32 [num_reqs + 1]
    seq_lens: Any  #: int32 [num_reqs]
    block_table: Any  #: int32 [num_reqs, max_blocks_per_req]


class HalAttentionMetadataBuilder(AttentionMetadataBuilder[HalAttentionMetadata]):  # type: ignore[misc, unused-ignore]
    """Passes vLLM's common metadata through; checks the group's cache spec once, at start-up."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_cache_spec(kv_cache_spec, vllm_config)
        self.route = Route(serving_backend(device.type))

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> HalAttentionMetadata:
        common = common_attn_metadata
        if common.causal is not True:
            raise ValueError(
                "hal-vllm: hal's paged_attention is causal; this batch asks for non-causal attention "
                "(unset HAL_VLLM for this model)"
            )
        num_reqs = common.num_reqs
        native = self.route.native
        return HalAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=native(common.query_start_loc[: num_reqs + 1], "query_start_loc"),
            seq_lens=native(common.seq_lens[:num_reqs], "seq_lens"),
            block_table=native(common.block_table_tensor[:num_reqs], "block_tables"),
        )


class HalAttentionImpl(AttentionImpl):  # type: ignore[misc, unused-ignore]
    """One vLLM attention layer on hal's ops; refuses at construction what hal cannot run exactly."""

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
        self.scale = self.plan.options.scale
        self.sliding_window = self.plan.options.window
        self._caches: tuple[torch.Tensor, Any, Any] | None = None  # vLLM's cache tensor, its K and V as hal arrays
        self._options: AttentionOptions | None = None  # built at the first step after loading, then passed unchanged
        #: (K, options, write_kv_cache, paged_attention): the two ops bound to the caches and options they were for
        self._bound: tuple[Any, AttentionOptions, BoundOp, BoundOp] | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self._options = None  # the sinks (a weight of the layer) may have changed

    def _kv(self, kv_cache: torch.Tensor) -> tuple[Any, Any]:
        """The K and V halves of ``kv_cache`` as the backend's arrays, made once per cache tensor."""
        cached = self._caches
        if cached is None or cached[0] is not kv_cache:
            key_cache, value_cache = split_kv_cache(kv_cache)
            native = self.plan.route.native
            cached = (kv_cache, native(key_cache, "key_cache"), native(value_cache, "value_cache"))
            self._caches = cached
        return cached[1], cached[2]

    def _ops(self, kv_cache: torch.Tensor) -> tuple[BoundOp, BoundOp]:
        """``write_kv_cache`` and ``paged_attention`` bound to ``kv_cache``'s K and V and the layer's options (bound
        again when vLLM hands a new cache tensor or the weights are reloaded)."""
        key_cache, value_cache = self._kv(kv_cache)
        options = self.layer_options()
        bound = self._bound
        if bound is None or bound[0] is not key_cache or bound[1] is not options:
            ops = self.plan.route.ops
            bound = self._bound = (key_cache, options,
                                   ops.bind("write_kv_cache", key_cache=key_cache, value_cache=value_cache),
                                   ops.bind("paged_attention", key_cache=key_cache, value_cache=value_cache,
                                            options=options))
        return bound[2], bound[3]

    def layer_options(self) -> AttentionOptions:
        """The layer's :class:`~hal_core.AttentionOptions`, its sinks as the backend's float32 array: built once
        (again after the weights are reloaded), the same object on every call."""
        if self._options is None:
            sinks = None if self.sinks is None else self.plan.route.native(self.sinks.detach().float(), "sinks")
            self._options = self.plan.options_with(sinks)
        return self._options

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """hal's ``write_kv_cache`` of this step's keys and values (slot -1: padding, skipped)."""
        write, _ = self._ops(kv_cache)
        num_tokens = slot_mapping.shape[0]
        native = self.plan.route.native
        write(key=native(key[:num_tokens], "key"), value=native(value[:num_tokens], "value"),
              slot_mapping=native(slot_mapping, "slot_mapping"))

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
        _, attend = self._ops(kv_cache)
        native = self.plan.route.native
        attend(query=native(query[:num_tokens], "query"), block_tables=meta.block_table, seq_lens=meta.seq_lens,
               query_start_loc=meta.query_start_loc, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
               out=native(output[:num_tokens], "out"))
        return output


class HalBackendTraits:
    """What vLLM asks of an attention backend, answered for hal's ops; mixed in before vLLM's backend class.

    Decoder attention (causal), sinks and sliding windows, caches in the
    model's dtype, the KV update outside ``forward``; any head size (the
    serving backend's declaration is checked when a layer is built).
    """

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
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
