"""A transformers attention backend, ``attn_implementation="hal"``, over a hal paged KV cache.

Importing this module registers, through transformers' public interfaces:

- ``AttentionInterface.register("hal", hal_attention_forward)``: the attention function;
- ``AttentionMaskInterface.register("hal", hal_attention_mask)``: the mask it wants
  (the 2D padding mask as given, like FlashAttention's: causality is the paged
  kernel's, so no 4D mask is ever built).

A model generates through hal when it uses the backend *and* a
:class:`HalPagedCache`::

    import hal_core.torch.transformers as hal_hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hal")
    cache = hal_hf.HalPagedCache(model.config, num_blocks=64, block_size=16, dtype=model.dtype)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False)

Each layer's ``past_key_values.update`` (called by the model right before its
attention) hands the layer's new keys and values to the attention function
through a per-thread forward context; the attention function writes them into
the layer's hal cache with ``hal::write_kv_cache`` (pad tokens skipped) and
attends with one ``hal::paged_attention`` call per layer and step, whatever the
number of new tokens: the real new tokens of every sequence packed, with
``query_start_loc`` (a prompt is one causal prefill, not one decode per token).
The step's slot mapping, block tables, lengths and packing come from
:class:`hal_core.kvcache.PagedKVCache`, planned once per forward and shared by
every layer. What the model's layers declare passes through: a sliding window
(``sliding_window``: Mistral, Qwen2, Gemma 2/3), a logit softcap (``softcap``:
Gemma 2) and attention sinks (``s_aux``: gpt-oss).

What falls back: without a :class:`HalPagedCache` (a ``DynamicCache``, or no
cache) the ``"hal"`` attention runs torch's scaled-dot-product attention on the
keys and values transformers passes (logged once; ``HAL_STRICT=1`` raises
instead; it refuses what SDPA cannot honour: windows, softcaps, sinks).
Transformers' continuous batching (``generate_batch``, whose cache transformers
owns in its own layout), beam search and cache cropping raise a clear error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface, Cache
from transformers.cache_utils import CacheLayerMixin

from .. import _env
from .._errors import FallbackError
from ..interop import host_view
from ..kvcache import CacheConfig, PagedKVCache
from ._convert import to_tensor
from ._ops import paged_attention, write_kv_cache
from ._routing import backend_for

__all__ = ["ATTN_IMPLEMENTATION", "HalPagedCache", "hal_attention_forward", "hal_attention_mask", "register"]

log = logging.getLogger("hal")

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "hal"

_HAL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_context = threading.local()
_warned: set[str] = set()


@dataclass(frozen=True)
class _Plan:
    """One forward's index tensors and hints, shared by every layer."""

    step: int
    rows: torch.Tensor | None  #: flat ``b * q_len + i`` of each real new token (None: every token is real)
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    #: The step's index arrays as the cache's own arrays (numpy on a host backend), for eager calls.
    native: dict[str, Any]


class _HalLayer(CacheLayerMixin):
    """One layer of a :class:`HalPagedCache`: counts its tokens; the keys and values live in hal's cache."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: HalPagedCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.length = 0  # positions seen, pads included (what transformers counts)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.owner._enter_layer(self.index, key_states, value_states)
        self.is_initialized = True
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("HalPagedCache does not reorder sequences (beam search); use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("HalPagedCache cannot drop tokens (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("HalPagedCache cannot repeat sequences; pass num_return_sequences=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("HalPagedCache cannot select sequences")


class HalPagedCache(Cache):
    """A transformers ``Cache`` whose keys and values live in a :class:`hal_core.kvcache.PagedKVCache`.

    ``config`` is the model's config (its text config for multimodal
    models); ``num_blocks`` blocks of ``block_size`` tokens per layer are
    allocated on ``device`` by the hal backend that owns it, in ``dtype``
    (the model's). Batch row ``b`` is hal sequence ``b``; left padding is
    skipped (pads are never written, so they are never read). One cache
    serves one ``generate`` call; :meth:`close` frees its memory.
    """

    def __init__(self, config: Any, *, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
        if dtype not in _HAL_DTYPES:
            raise TypeError(f"HalPagedCache: dtype must be one of {sorted(map(str, _HAL_DTYPES))}, got {dtype}")
        device = torch.device(device)
        backend = backend_for(torch.empty(0, device=device))
        index = device.index if device.index is not None else (
            0 if device.type == "cpu" else torch.get_device_module(device).current_device())
        hal_config = CacheConfig(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_size=head_size,
                                 block_size=block_size, dtype=_HAL_DTYPES[dtype])
        self.paged = PagedKVCache(backend, hal_config, num_blocks=num_blocks, device=index)
        self.key_caches = [to_tensor(a) for a in self.paged.key_caches]
        self.value_caches = [to_tensor(a) for a in self.paged.value_caches]
        self.device = device
        self._batch: int | None = None
        self._step = 0
        self._plan: _Plan | None = None
        super().__init__(layers=[_HalLayer(self, i) for i in range(text.num_hidden_layers)])

    # -- called by the layers and the attention function -----------------------

    def _enter_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        previous = getattr(_context, "current", None)
        if previous is not None and previous[0] is self:  # the last layer's keys never reached hal
            _context.current = None
            raise RuntimeError(
                f"HalPagedCache: layer {previous[1]}'s keys and values were not consumed by the 'hal' attention "
                f"function; load the model with attn_implementation='hal' (another attention implementation "
                f"would see only the new tokens)"
            )
        if layer == 0:
            self._step += 1
        _context.current = (self, layer, key)

    def _plan_for(self, attention_mask: torch.Tensor | None, batch: int, q_len: int) -> _Plan:
        if self._plan is not None and self._plan.step == self._step:
            return self._plan
        if self._batch is not None and batch != self._batch:
            raise ValueError(f"HalPagedCache holds {self._batch} sequences, but this forward has batch {batch}; "
                             f"use a new cache per generate call")
        if attention_mask is None:
            real = np.ones((batch, q_len), dtype=bool)
        elif attention_mask.ndim != 2:
            raise ValueError(f"attn_implementation='hal' takes the 2D padding mask [batch, length], got a mask of "
                             f"shape {tuple(attention_mask.shape)}")
        else:
            real = attention_mask[:, -q_len:].to("cpu", torch.bool).numpy()
        counts = real.sum(axis=1)
        for b in range(batch):  # pads may only precede a sequence's first token (left padding)
            expected = np.arange(q_len) >= q_len - counts[b]
            held = self.paged.blocks.length(b) if self._batch is not None else 0
            if not np.array_equal(real[b], expected) or (held and counts[b] != q_len):
                raise ValueError(f"HalPagedCache supports left padding only: row {b} of the attention mask has a "
                                 f"pad after a real token")
        if self._batch is None:  # the first forward: one hal sequence per batch row
            for b in range(batch):
                self.paged.add(b)
            self._batch = batch
        new_tokens: dict[Hashable, int] = {b: int(counts[b]) for b in range(batch)}
        step = self.paged.prepare_step(new_tokens)
        rows = None
        if not real.all():
            rows = torch.from_numpy(np.flatnonzero(real.reshape(-1))).to(self.device)
        self._plan = _Plan(self._step, rows, to_tensor(step.slot_mapping), to_tensor(step.query_start_loc),
                           to_tensor(step.block_tables), to_tensor(step.seq_lens), step.max_query_len,
                           step.max_seq_len, {"slot_mapping": step.slot_mapping, **step.attention_args()})
        return self._plan

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Give the hal cache's memory back; the cache is unusable afterwards."""
        self.key_caches, self.value_caches = [], []
        self.paged.close()

    def reset(self) -> None:
        raise NotImplementedError("HalPagedCache serves one generate call; make a new one")


def hal_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor | None:
    """The mask ``"hal"`` attention reads: the 2D padding mask ``[batch, kv_length]`` (None when there is none)."""
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


def hal_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [B, H, Q, D]``, ``key``/``value [B, KVH, Q, D]``.

    Returns ``(attn_output [B, Q, H, D], None)`` (no attention weights).
    """
    if kwargs.get("cache") is not None:
        raise ValueError("attn_implementation='hal' does not run transformers' continuous batching "
                         "(generate_batch): its paged cache has transformers' own layout; use generate() with "
                         "past_key_values=HalPagedCache(...)")
    if dropout and module.training:
        raise ValueError("attn_implementation='hal' is for inference: dropout is not supported")
    batch, heads, q_len, head_size = query.shape
    scale = float(scaling) if scaling is not None else head_size ** -0.5
    window, softcap, sinks = _variants(module, kwargs)
    current = getattr(_context, "current", None)
    if current is None or current[2] is not key:
        return _torch_attention(query, key, value, attention_mask, scale, window, softcap, sinks)
    cache, layer, _ = current
    _context.current = None
    plan = cache._plan_for(attention_mask, batch, q_len)
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * q_len, heads, head_size)
    k = key.transpose(1, 2).reshape(batch * q_len, kv_heads, head_size)
    v = value.transpose(1, 2).reshape(batch * q_len, kv_heads, head_size)
    if plan.rows is not None:
        q, k, v = (t.index_select(0, plan.rows) for t in (q, k, v))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if cache.paged.backend.is_host and not torch.compiler.is_compiling():
        out = _host_attention(cache, layer, plan, q, k, v, scale, window, softcap, sinks)
    else:
        key_cache, value_cache = cache.key_caches[layer], cache.value_caches[layer]
        write_kv_cache(k, v, key_cache, value_cache, plan.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, plan.block_tables, plan.seq_lens, scale,
                              query_start_loc=plan.query_start_loc, max_query_len=plan.max_query_len,
                              max_seq_len=plan.max_seq_len, window=window, softcap=softcap, sinks=sinks)
    if plan.rows is not None:  # pad rows get zeros (transformers never reads them)
        out = query.new_zeros(batch * q_len, heads, head_size).index_copy_(0, plan.rows, out)
    return out.view(batch, q_len, heads, head_size), None


def _host_attention(cache: HalPagedCache, layer: int, plan: _Plan, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """Eager calls on a host cache: hal's front door on numpy views, the cache and the step's plan as hal holds
    them (no per-call conversion; the same ops, checks and kernels as ``hal::write_kv_cache`` /
    ``hal::paged_attention``)."""
    ops = cache.paged.backend.ops
    key_cache, value_cache = cache.paged.key_caches[layer], cache.paged.value_caches[layer]
    ops.write_kv_cache(host_view(k, "key"), host_view(v, "value"), key_cache, value_cache,
                       plan.native["slot_mapping"])
    out = torch.empty(q.shape, dtype=q.dtype)
    ops.paged_attention(host_view(q, "query"), key_cache, value_cache, plan.native["block_tables"],
                        plan.native["seq_lens"], scale=scale, out=host_view(out, "out"),
                        query_start_loc=plan.native["query_start_loc"], max_query_len=plan.max_query_len,
                        max_seq_len=plan.max_seq_len, window=window, softcap=softcap,
                        sinks=None if sinks is None else host_view(sinks, "sinks"))
    return out


def _variants(module: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[int | None, float | None, torch.Tensor | None]:
    """The layer's sliding window, logit softcap and attention sinks, as transformers passes them."""
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).reshape(-1).contiguous()
    return (int(window) if window is not None else None, float(softcap) if softcap is not None else None, sinks)


def _torch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scale: float, window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """The fallback without a HalPagedCache: causal SDPA over what transformers passed (nothing through hal)."""
    if window is not None or softcap is not None or sinks is not None:
        raise ValueError("attn_implementation='hal' needs past_key_values=HalPagedCache(...) for a model with a "
                         "sliding window, logit softcap or attention sinks (torch SDPA, the fallback, has none)")
    reason = "no HalPagedCache in use (pass past_key_values=HalPagedCache(...)); attention runs in torch SDPA"
    if _env.strict():
        raise FallbackError(f"attn_implementation='hal': {reason}; unset HAL_STRICT to allow it")
    if reason not in _warned:
        _warned.add(reason)
        log.warning("hal: %s", reason)
    q_len, kv_len = query.shape[2], key.shape[2]
    positions = torch.arange(kv_len, device=query.device)
    mask = positions[None, :] <= (positions[kv_len - q_len:, None])  # [Q, KV] causal, queries are the last Q
    mask = mask[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -kv_len:].to(torch.bool)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"hal"`` with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hal_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hal_attention_mask)


register()
