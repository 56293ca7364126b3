"""A transformers attention backend, ``attn_implementation="hal"``, over a hal paged KV cache.

Importing this module registers, through transformers' public interfaces:

- ``AttentionInterface.register("hal", hal_attention_forward)``: the attention function;
- ``AttentionMaskInterface.register("hal", hal_attention_mask)``: the mask it wants
  (the 2D padding mask as given, like FlashAttention's: causality is the paged
  kernel's, so no 4D mask is ever built). A mask pattern the kernel cannot
  run (chunked, bidirectional, packed sequences, image-token blocks) is refused.

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
every layer. What the model's layers declare passes through, as one
:class:`~hal_core.AttentionOptions` per layer built at its first call and passed
unchanged on every call (:mod:`._tf_options`): the scale, a sliding window
(``sliding_window``: Mistral, Qwen2, Gemma 2/3), a logit softcap (``softcap``:
Gemma 2) and attention sinks (``s_aux``: gpt-oss).

Under ``torch.compile`` (``model.forward = torch.compile(model.forward)``) the
step is planned, eagerly, by the mask function (which transformers calls before
the layers, right after the cache's ``get_mask_sizes``): that is the forward's
one graph break (one per kind of mask the model builds), and every layer's
projections, ``hal::write_kv_cache`` and ``hal::paged_attention`` trace into one
graph (docs/engine-guide.md, "Compiling a model").

What falls back: without a :class:`HalPagedCache` (a ``DynamicCache``, or no
cache) the ``"hal"`` attention runs torch's scaled-dot-product attention on the
keys and values transformers passes (logged once; ``HAL_STRICT=1`` raises
instead; it refuses what SDPA cannot honour: windows, softcaps, sinks).
What is refused, by name: ``output_attentions`` (hal returns no weights),
non-causal attention, transformers' continuous batching (``generate_batch``,
whose cache transformers owns in its own layout). docs/engine-guide.md has the
table of every cache use.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface

from .. import _env
from .._errors import ArgumentError, FallbackError
from ..ops import AttentionOptions
from ._convert import to_tensor
from ._ops import paged_attention, write_kv_cache
from ._tf_cache import HalPagedCache, _context
from ._tf_mask import check_mask_function
from ._tf_options import layer_options, layer_values
from ._tf_plan import Plan

__all__ = ["ATTN_IMPLEMENTATION", "HalPagedCache", "hal_attention_forward", "hal_attention_mask", "register"]

HalPagedCache.__module__ = __name__  # documented here

log = logging.getLogger("hal")

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "hal"

_warned: set[str] = set()


def hal_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor | None:
    """The mask ``"hal"`` attention reads: the 2D padding mask ``[batch, positions seen]``, or None.

    The mask function must be transformers' causal one, or causal with a
    sliding window: anything else is a pattern the paged kernel would ignore,
    so it raises :class:`~hal_core.ArgumentError`. The mask must cover the
    positions seen (the cache's and this forward's) exactly; without one, a
    cache longer than what it has seen (a ``StaticCache``) gets an all-ones
    mask of the positions seen, so the attention knows where its queries are.
    """
    cache = getattr(_context, "masking", None) if torch.compiler.is_compiling() else None
    if cache is not None:  # compiled: the HalPagedCache that sized this mask plans its step here
        _context.masking = None
        _mask_stage(mask_function, cache, attention_mask, batch_size, q_length, kwargs.get("config"))
    else:
        check_mask_function(mask_function)
    if kv_offset:  # a sliding layer that dropped old keys: only the SDPA fallback meets it, and refuses windows
        return attention_mask
    seen = int(q_offset) + q_length
    if attention_mask is None:
        if seen == kv_length:
            return None
        return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))
    if attention_mask.ndim == 2 and attention_mask.shape[-1] != seen:
        raise ArgumentError(
            f"attention_mask has {attention_mask.shape[-1]} positions, but the cache has seen {seen - q_length} and "
            f"this forward adds {q_length}: pass the mask of the whole sequence ({seen} positions; generate() feeds "
            f"only the positions a cache lacks); for a new prompt call cache.reset() or use a new cache")
    return attention_mask


def hal_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [B, H, Q, D]``, ``key``/``value [B, KVH, Q, D]``.

    Returns ``(attn_output [B, Q, H, D], None)`` (no attention weights).
    """
    batch, heads, q_len, head_size = query.shape
    current = getattr(_context, "current", None)
    if current is not None and current[2] is not key:
        current = None
    scale = float(scaling) if scaling is not None else head_size ** -0.5
    compiling = torch.compiler.is_compiling()
    host = current is not None and current[0]._host and not compiling
    try:  # the config's options are checked by the forward's first layer (the layers share it)
        checked = current[0]._checked_config if current is not None and current[1] else None
        config = _check_options(module, dropout, kwargs, checked)
        if compiling:  # traced once: the values become the graph's constants
            window, softcap, sinks = layer_values(module, kwargs)
            options = AttentionOptions(scale=scale, window=window, softcap=softcap, sinks=sinks)
        else:  # built once per layer, the same object on every call
            options = layer_options(module, kwargs, scale, current[0].route if current is not None and host else None)
    except BaseException:
        if current is not None:  # the layer's keys were handed over: the refused forward never happened
            current[0]._undo_enter(current[1], q_len)
        raise
    if current is None:
        return _torch_attention(query, key, value, attention_mask, options)
    cache, layer, _ = current
    _context.current = None
    problem = _model_problem(cache, config) if layer == 0 else None
    if problem is not None:
        cache._undo_enter(layer, q_len)
        raise ArgumentError(problem)
    cache._checked_config = config
    if not compiling:
        plan = cache._plan_for(layer, attention_mask, batch, q_len)
    else:  # planned at the mask stage (one graph break before the layers), else here: a break in every layer
        plan = cache._plan if cache._ahead_plan else _plan_eager(cache, layer, attention_mask, batch, q_len)
    if plan.rows is None and host:
        out = _host_attention(cache, layer, plan, query, key, value, options)
        cache._written.add(layer)
        return out, None
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * q_len, heads, head_size)
    k = key.transpose(1, 2).reshape(batch * q_len, kv_heads, head_size)
    v = value.transpose(1, 2).reshape(batch * q_len, kv_heads, head_size)
    if plan.rows is not None:
        q, k, v = (t.index_select(0, plan.rows) for t in (q, k, v))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if host:
        out = _host_packed_attention(cache, layer, plan, q, k, v, options)
    else:
        key_cache, value_cache = cache.key_caches[layer], cache.value_caches[layer]
        write_kv_cache(k, v, key_cache, value_cache, plan.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, plan.block_tables, plan.seq_lens,
                              query_start_loc=plan.query_start_loc, max_query_len=plan.max_query_len,
                              max_seq_len=plan.max_seq_len, options=options)
    cache._written.add(layer)
    if plan.rows is not None:  # pad rows get zeros (transformers never reads them)
        out = query.new_zeros(batch * q_len, heads, head_size).index_copy_(0, plan.rows, out)
    return out.view(batch, q_len, heads, head_size), None


@torch.compiler.disable
def _mask_stage(mask_function: Any, cache: HalPagedCache, attention_mask: torch.Tensor | None, batch: int,
                q_len: int, config: Any) -> None:
    """A compiled forward's mask stage, run eagerly (the forward's graph break): the mask function checked (it
    is read through its closure, which a trace cannot), then ``cache``'s step planned, once the model's config
    (its layer count, key/value heads, head size) is checked against what the layers would refuse."""
    check_mask_function(mask_function)
    problem = _model_problem(cache, config)
    if problem is None and config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        shape = (getattr(text, "num_key_value_heads", None) or heads,
                 getattr(text, "head_dim", None) or text.hidden_size // heads)
        if shape != cache._states[:2]:
            problem = (f"past_key_values: the HalPagedCache holds {cache._states[0]} kv heads of "
                       f"{cache._states[1]}, the model {shape[0]} of {shape[1]}: build the cache from this "
                       f"model's config")
    if problem is not None:
        raise ArgumentError(problem)
    cache._plan_ahead(attention_mask, batch, q_len)


def _model_problem(cache: HalPagedCache, config: Any) -> str | None:
    """Why ``cache`` cannot serve the model of ``config`` (its layer count differs), or None; checked once a
    config."""
    if config is None or config is cache._layers_checked:
        return None
    model_layers = getattr(config, "num_hidden_layers", None)
    if model_layers is not None and model_layers != len(cache.layers):
        return (f"past_key_values: the HalPagedCache has {len(cache.layers)} layers, the model {model_layers}: "
                f"build the cache from this model's config")
    cache._layers_checked = config
    return None


@torch.compiler.disable
def _plan_eager(cache: HalPagedCache, layer: int, attention_mask: torch.Tensor | None, batch: int,
                q_len: int) -> Plan:
    """A compiled layer's step planned eagerly (a forward whose mask stage did not plan it)."""
    return cache._plan_for(layer, attention_mask, batch, q_len)


def _check_options(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any], checked: Any) -> Any:
    """Refuse, before any work, what hal's attention would otherwise ignore; returns the module's config.

    The config's own options are not read again when it is ``checked`` (this forward's first layer read them).
    """
    if kwargs.get("cache") is not None:
        raise ArgumentError("attn_implementation='hal' does not run transformers' continuous batching "
                            "(generate_batch): its paged cache has transformers' own layout; use generate() with "
                            "past_key_values=HalPagedCache(...)")
    if dropout and module.training:
        raise ArgumentError("attn_implementation='hal' is for inference: dropout is not supported (model.eval(), "
                            "or attn_implementation='sdpa' for training)")
    config = getattr(module, "config", None)
    if "output_attentions" in kwargs:
        wanted = kwargs["output_attentions"]
    else:
        wanted = config is not checked and getattr(config, "output_attentions", False)
    if wanted:
        raise ArgumentError("output_attentions=True: attn_implementation='hal' computes no attention weights; load "
                            "the model with attn_implementation='eager' (or model.set_attn_implementation('eager')) "
                            "to get them")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise ArgumentError("attn_implementation='hal' runs causal attention only; this layer is not causal "
                            "(is_causal=False): use attn_implementation='sdpa' or 'eager'")
    if kwargs.get("position_bias") is not None:
        raise ArgumentError("attn_implementation='hal' has no additive position bias (position_bias); use "
                            "attn_implementation='sdpa' or 'eager'")
    return config


def _host_attention(cache: HalPagedCache, layer: int, plan: Plan, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
    """A step without pads on a host cache: ``[B, H, Q, D]`` in, ``[B, Q, H, D]`` out, on numpy views of the
    model's tensors (copied only where a layout is not contiguous), through hal's front door."""
    batch, heads, q_len, head_size = query.shape
    native = cache.route.native
    q, k, v = (np.ascontiguousarray(native(t, name).transpose(0, 2, 1, 3).reshape(batch * q_len, t.shape[1],
                                                                                  head_size))
               for t, name in ((query, "query"), (key, "key"), (value, "value")))
    out = np.empty((batch, q_len, heads, head_size), dtype=q.dtype)
    _host_ops(cache, layer, plan, q, k, v, out.reshape(batch * q_len, heads, head_size), options)
    return to_tensor(out)


def _host_packed_attention(cache: HalPagedCache, layer: int, plan: Plan, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
    """The packed real tokens ``[T, heads, D]`` of a step with pads, on a host cache."""
    out = torch.empty(q.shape, dtype=q.dtype)
    native = cache.route.native
    _host_ops(cache, layer, plan, native(q, "query"), native(k, "key"), native(v, "value"), native(out, "out"),
              options)
    return out


def _host_ops(cache: HalPagedCache, layer: int, plan: Plan, q: np.ndarray, k: np.ndarray, v: np.ndarray,
              out: np.ndarray, options: AttentionOptions) -> None:
    """Eager calls on a host cache through its route (:class:`~hal_core.torch.HostRoute`: the front door on numpy
    arrays, with the layer's caches and options bound once, :meth:`HalPagedCache.host_layer_ops`), the step's plan
    as hal holds it (no per-call conversion; the same ops, checks and kernels as ``hal::write_kv_cache`` /
    ``hal::paged_attention``)."""
    native = plan.native
    write, attend = cache.host_layer_ops(layer, options)
    write(key=k, value=v, slot_mapping=native["slot_mapping"])
    attend(query=q, block_tables=native["block_tables"], seq_lens=native["seq_lens"], out=out,
           query_start_loc=native["query_start_loc"], max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len)


def attend_rows(module: torch.nn.Module, cache: HalPagedCache, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                attention_mask: torch.Tensor | None, scaling: float | None, dtype: torch.dtype, batch: int,
                q_len: int, kwargs: dict[str, Any]) -> np.ndarray:
    """``cache.update`` then :func:`hal_attention_forward` for a caller holding numpy rows (kernelize's lean layers):
    the same checks, plan, ops and kernels on a host cache, without torch tensors in between.

    ``query`` ``[T, H, D]``, ``key``/``value`` ``[T, KVH, D]`` (``T = batch * q_len``, batch-major rows, the states'
    ``dtype``); ``kwargs`` what the attention function would get. Returns the output ``[T, H, D]``. For a
    :class:`HalPagedCache` on a host backend, uncompiled (:func:`rows_served`).
    """
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    cache._enter_rows(layer, (batch, key.shape[1], q_len, key.shape[2]), dtype)
    scale = float(scaling) if scaling is not None else query.shape[2] ** -0.5
    try:
        config = _check_options(module, 0.0, kwargs, cache._checked_config if layer else None)
        options = layer_options(module, kwargs, scale, cache.route)
    except BaseException:
        cache._undo_enter(layer, q_len)  # the refused forward never happened
        raise
    problem = _model_problem(cache, config) if layer == 0 else None
    if problem is not None:
        cache._undo_enter(layer, q_len)
        raise ArgumentError(problem)
    cache._checked_config = config
    plan = cache._plan_for(layer, attention_mask, batch, q_len)
    q, k, v = np.ascontiguousarray(query), np.ascontiguousarray(key), np.ascontiguousarray(value)
    if plan.rows is None:
        out = np.empty(q.shape, q.dtype)
        _host_ops(cache, layer, plan, q, k, v, out, options)
    else:  # the real tokens packed, as _host_packed_attention runs them; pad rows get zeros
        rows = plan.rows.numpy()
        packed = np.empty((len(rows), *q.shape[1:]), q.dtype)
        _host_ops(cache, layer, plan, q[rows], k[rows], v[rows], packed, options)
        out = np.zeros(q.shape, q.dtype)
        out[rows] = packed
    cache._written.add(layer)
    return out


def rows_served(cache: Any, attention: Any) -> bool:
    """Whether :func:`attend_rows` serves a layer whose cache is ``cache`` and attention function ``attention``."""
    return type(cache) is HalPagedCache and cache._host and attention is hal_attention_forward \
        and not torch.compiler.is_compiling()


def _torch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, options: AttentionOptions) -> tuple[torch.Tensor, None]:
    """The fallback without a HalPagedCache: SDPA over what transformers passed (nothing through hal).

    A 2D padding mask covers the positions seen; the queries are its last
    ``q_len`` (keys past it, a ``StaticCache``'s empty slots, are masked),
    under a causal mask; a custom 4D mask is the whole mask (boolean: True attends; float: added to the scores), as with
    ``attn_implementation="sdpa"``.
    """
    if options.window is not None or options.softcap is not None or options.sinks is not None:
        raise ArgumentError("attn_implementation='hal' needs past_key_values=HalPagedCache(...) for a model with a "
                            "sliding window, logit softcap or attention sinks (torch SDPA, the fallback, has none)")
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is not None and attention_mask.ndim == 4:
        shape = tuple(attention_mask.shape)
        if shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2:] != (q_len, kv_len):
            raise ArgumentError(f"attention_mask: a 4D mask must have shape ({batch} or 1, {heads} or 1, {q_len}, "
                                f"{kv_len}) (batch, heads, queries, keys), got {shape}")
    elif attention_mask is not None and attention_mask.ndim != 2:
        raise ArgumentError(f"attention_mask must be 2D [batch, length] or 4D [batch, heads, queries, keys], got "
                            f"shape {tuple(attention_mask.shape)}")
    reason = "no HalPagedCache in use (pass past_key_values=HalPagedCache(...)); attention runs in torch SDPA"
    if _env.strict():
        raise FallbackError(f"attn_implementation='hal': {reason}; unset HAL_STRICT to allow it")
    if reason not in _warned:
        _warned.add(reason)
        log.warning("hal: %s", reason)
    if attention_mask is not None and attention_mask.ndim == 4:
        mask = attention_mask.to(query.device)
        if mask.dtype != torch.bool:
            mask = mask.to(query.dtype)
    else:  # the queries are the last of the positions seen: the mask's length, else every key (a DynamicCache)
        seen = kv_len if attention_mask is None else attention_mask.shape[1]
        if not q_len <= seen <= kv_len:
            raise ArgumentError(f"attention_mask has {seen} positions for {q_len} queries and {kv_len} keys; it must "
                                f"cover the positions seen (at least the queries, at most the keys)")
        positions = torch.arange(kv_len, device=query.device)
        mask = (positions[None, :] <= positions[seen - q_len:seen, None])[None, None]  # causal
        if attention_mask is not None:  # keys past the positions seen (a StaticCache's empty slots) are padding
            padding = torch.nn.functional.pad(attention_mask.to(query.device, torch.bool), (0, kv_len - seen))
            mask = mask & padding[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=options.scale,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"hal"`` with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hal_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hal_attention_mask)


register()
