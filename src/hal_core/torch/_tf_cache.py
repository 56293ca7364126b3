""":class:`HalPagedCache`: a transformers ``Cache`` whose keys and values live in a hal paged KV cache.

Batch row ``b`` is one hal sequence; the cache records, for every position
transformers has seen, whether it was a real token or a pad, so a later
forward's attention mask can be checked against what the cache holds. The
row operations transformers' decoding strategies call (``reorder_cache``,
``batch_repeat_interleave``, ``batch_select_indices``) fork hal sequences
(full blocks shared, a partial last block copied), and ``crop`` shortens
them: each leaves the cache exactly as a ``DynamicCache`` would be, or raises
before changing anything.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .._errors import ArgumentError, OutOfBlocksError
from ..kvcache import CacheConfig, PagedKVCache
from ..ops import BoundOp
from ._convert import to_tensor
from ._dtypes import FLOAT_DTYPE_NAMES
from ._host import route_for
from ._tf_plan import Plan, Seen, make_plan, new_positions, same_mask

__all__ = ["HalPagedCache"]

#: The device of states handed over as numpy rows (:meth:`HalPagedCache._enter_rows`).
_HOST = torch.device("cpu")
#: Per thread: ``current``, the layer whose new keys and values the next ``"hal"`` attention call consumes
#: (``(cache, layer, key)``); ``masking``, the cache that sized the mask the ``"hal"`` mask function makes next
#: (set under torch.compile only). Set here for the importing thread, so that its compiled forwards meet them in
#: one state from the first (a thread's first compiled forward sees them unset, then set: one more compile).
_context = threading.local()
_context.current = None
_context.masking = None


class _HalLayer(CacheLayerMixin):
    """One layer of a :class:`HalPagedCache`: counts its positions; the keys and values live in hal's cache.

    The row operations act on every layer at once, so they live on the cache; a layer refuses them.
    """

    #: generate()'s own compilation wants static shapes (and CUDA graphs); this cache plans every step on the host.
    #: Compile the model's forward instead (docs/engine-guide.md, "Compiling a model").
    is_compileable = False
    is_croppable = True
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

    def offload(self) -> None:
        raise NotImplementedError("HalPagedCache keeps its keys and values in hal's cache; it does not offload")

    def prefetch(self) -> None:
        raise NotImplementedError("HalPagedCache keeps its keys and values in hal's cache; it does not offload")

    def _whole_cache(self, name: str) -> None:
        raise NotImplementedError(f"HalPagedCache.{name} acts on every layer at once: call it on the cache, "
                                  f"not on layer {self.index}")

    def reset(self) -> None:
        self._whole_cache("reset")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole_cache("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole_cache("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache("batch_select_indices")


class HalPagedCache(Cache):
    """A transformers ``Cache`` whose keys and values live in a :class:`hal_core.kvcache.PagedKVCache`.

    ``config`` is the model's config (its text config for multimodal
    models); ``num_blocks`` blocks of ``block_size`` tokens per layer are
    allocated on ``device`` by the hal backend that owns it, in ``dtype``
    (the model's). Batch row ``b`` is one hal sequence; left padding is
    skipped (pads are never written, so they are never read).

    Like a ``DynamicCache``, a cache that holds tokens is *continued* by the
    next forward or ``generate`` call (a chat's next turn: pass the whole
    conversation and its whole attention mask); :meth:`reset` empties it for
    a new prompt. The row operations of beam search and the ``crop`` of
    assisted decoding are exact. :meth:`close` frees its memory.
    """

    def __init__(self, config: Any, *, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
        if dtype not in FLOAT_DTYPE_NAMES:
            raise TypeError(f"HalPagedCache: dtype must be one of {sorted(map(str, FLOAT_DTYPE_NAMES))}, got {dtype}")
        device = torch.device(device)
        route = route_for(torch.empty(0, device=device))
        backend = route.backend
        index = device.index if device.index is not None else (
            0 if device.type == "cpu" else torch.get_device_module(device).current_device())
        hal_config = CacheConfig(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_size=head_size,
                                 block_size=block_size, dtype=FLOAT_DTYPE_NAMES[dtype])
        self.paged = PagedKVCache(backend, hal_config, num_blocks=num_blocks, device=index)
        self.key_caches = [to_tensor(a) for a in self.paged.key_caches]
        self.value_caches = [to_tensor(a) for a in self.paged.value_caches]
        self.device = device
        #: How the layers' eager calls reach the backend (on the host: its front door, on numpy views).
        self.route = route
        self._host = backend.is_host
        #: What every layer's key and value states must be: kv heads, head size, dtype, device.
        self._states = (kv_heads, head_size, self.key_caches[0].dtype, self.key_caches[0].device)
        self._seq_ids: list[Hashable] | None = None  # hal sequence of each batch row; None: no forward yet
        self._seen = Seen()  # [batch, positions]: which positions seen were real tokens
        self._next_id = 0
        self._step = 0
        self._plan: Plan | None = None
        self._checked_config: Any = None  # the model config whose options this forward's first layer checked
        self._layers_checked: Any = None  # the model config whose layer count matched the cache's
        self._mask_seen: torch.Tensor | None = None  # the last forward's device mask (None: host, or changed since)
        self._entered: set[int] = set()  # layers whose keys this step handed over, and those hal wrote
        self._written: set[int] = set()
        self._most_written = 0  # the most layers one step wrote: a step that wrote fewer broke off
        self._broken: str | None = None  # why the cache no longer matches the tokens it counts
        #: Under torch.compile, the step planned at the mask stage, before its layers (``(batch, q_len, seen, mask)``;
        #: None: none waits), and whether the running forward's plan was made so (its layers read ``_plan`` as is).
        self._ahead_pending: tuple[int, int, int, torch.Tensor | None] | None = None
        self._ahead_plan = False
        self._layers = [_HalLayer(self, i) for i in range(text.num_hidden_layers)]
        #: Per layer on a host backend: (its options, write_kv_cache and paged_attention bound to its caches).
        self._bound: list[tuple[Any, BoundOp, BoundOp] | None] = [None] * text.num_hidden_layers
        super().__init__(layers=list(self._layers))

    # -- called by the layers and the attention function -----------------------

    def _enter_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A layer hands over its new keys and values: checked against the cache before anything changes."""
        self._enter(layer, (("key", key.shape, key.dtype, key.device), ("value", value.shape, value.dtype,
                                                                        value.device)), key)

    def _enter(self, layer: int, states: Sequence[tuple[str, Sequence[int], torch.dtype, torch.device]],
               key: Any) -> None:
        """:meth:`_enter_layer` on the states' ``(name, [B, KVH, Q, D] shape, dtype, device)``; ``key`` identifies the
        hand-over to the attention call that follows (``_context.current``)."""
        if not self.key_caches:
            raise ArgumentError("past_key_values: this HalPagedCache was closed (memory given back); make a new one")
        expected = self._states
        for name, shape, dtype, device in states:
            if (len(shape) != 4 or shape[1] != expected[0] or shape[3] != expected[1] or dtype != expected[2]
                    or device != expected[3]):
                config = self.paged.config
                raise ArgumentError(
                    f"HalPagedCache layer {layer}: the model's {name} states are {tuple(shape)} {dtype} "
                    f"on {device}, the cache holds {config.num_kv_heads} kv heads of {config.head_size} "
                    f"{self.key_caches[layer].dtype} on {self.key_caches[layer].device}: build the cache from this "
                    f"model's config, dtype and device")
        ahead = layer == 0 and self._ahead_pending is not None  # the step was planned at the mask stage
        if layer == 0 and not ahead:
            self._end_step()
        if self._broken is not None:
            raise ArgumentError(f"HalPagedCache: {self._broken}; call cache.reset() (or use a new cache)")
        previous = getattr(_context, "current", None)
        if previous is not None and previous[0] is self:  # the last layer's keys never reached hal
            _context.current = None
            raise RuntimeError(
                f"HalPagedCache: layer {previous[1]}'s keys and values were not consumed by the 'hal' attention "
                f"function; load the model with attn_implementation='hal' (another attention implementation "
                f"would see only the new tokens)"
            )
        if layer == 0:
            self._ahead_pending, self._ahead_plan = None, ahead
            if not ahead:
                self._step += 1
        self._entered.add(layer)
        _context.current = (self, layer, key)

    def _enter_rows(self, layer: int, shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
        """What ``update`` does for a caller that holds layer ``layer``'s new keys and values as numpy rows (of
        ``[B, KVH, Q, D]`` states) and attends at once (:func:`~hal_core.torch.transformers.attend_rows`): the
        hand-over checked and counted."""
        self._enter(layer, (("key", shape, dtype, _HOST), ("value", shape, dtype, _HOST)), None)
        _context.current = None  # consumed by the caller's attention call, which follows
        counted = self._layers[layer]
        counted.is_initialized = True
        counted.length += shape[2]

    def _undo_enter(self, layer: int | None, q_len: int) -> None:
        """A refusal right after ``layer`` handed over its keys (None: while planning at the mask stage, before any
        layer): as if the forward had not happened."""
        if layer is None:
            self._step -= 1
            return
        self._layers[layer].length -= q_len
        self._entered.discard(layer)
        _context.current = None

    def _plan_ahead(self, attention_mask: torch.Tensor | None, batch: int, q_len: int) -> None:
        """Under torch.compile, the forward's step planned at the mask stage, before the model's layers.

        Planning is host work (the mask read, blocks allocated, index arrays), so it runs eagerly; done
        here, outside the loop over the layers, it is the compiled forward's one graph break and every layer
        traces into one graph. A model whose masks come in two kinds (full and sliding) calls this twice
        per forward: the second call, with the same sizes and mask while the plan waits for the layers, keeps
        it (the plan is all they decide; comparing a device mask reads it back, only on such a second call).
        """
        seen = self._layers[0].length
        pending = self._ahead_pending
        if pending is not None and pending[:3] == (batch, q_len, seen) and same_mask(pending[3], attention_mask):
            return
        if not self.key_caches:
            raise ArgumentError("past_key_values: this HalPagedCache was closed (memory given back); make a new one")
        if self._ahead_pending is not None:  # a forward planned here never reached its layers
            self._broken = "a forward broke off before its layers after its step was planned"
        self._end_step()
        if self._broken is not None:
            raise ArgumentError(f"HalPagedCache: {self._broken}; call cache.reset() (or use a new cache)")
        self._step += 1
        self._plan_for(None, attention_mask, batch, q_len)
        self._ahead_pending = (batch, q_len, seen, attention_mask)

    def _end_step(self) -> None:
        """Between forwards: a forward that broke off after hal planned its step leaves layers unwritten."""
        if self._plan is not None and self._plan.step == self._step and self._broken is None:
            missing = sorted(self._entered - self._written)
            if missing or len(self._written) < self._most_written:
                first = missing[0] if missing else len(self._written)
                self._broken = (f"a forward broke off at layer {first} after its tokens were counted, so the cache "
                                f"no longer matches them")
        self._most_written = max(self._most_written, len(self._written))
        self._entered, self._written = set(), set()

    def _plan_for(self, layer: int | None, attention_mask: torch.Tensor | None, batch: int, q_len: int) -> Plan:
        """The step's plan, made by the first layer's attention call; a refusal leaves the cache as it was."""
        plan = self._plan
        if plan is not None and plan.step == self._step:
            return plan
        try:
            if self._seq_ids is not None and batch != len(self._seq_ids):
                raise ArgumentError(
                    f"HalPagedCache holds {len(self._seq_ids)} sequences, but this forward has batch {batch}; a "
                    f"cache that holds tokens is continued (as a DynamicCache is): call cache.reset() or use a new "
                    f"cache for another batch")
            real, mask = new_positions(attention_mask, self._seen.array, self._mask_seen, batch, q_len)
        except BaseException:
            self._undo_enter(layer, q_len)  # the refused forward never happened
            raise
        first = self._seq_ids is None
        seq_ids = [self._new_id() for _ in range(batch)] if self._seq_ids is None else self._seq_ids
        all_real = bool(real.all())
        counts = dict.fromkeys(seq_ids, q_len) if all_real else {
            s: int(c) for s, c in zip(seq_ids, real.sum(axis=1), strict=True)}
        try:
            if first:  # the first forward: one hal sequence per batch row
                for seq_id in seq_ids:
                    self.paged.add(seq_id)
            step = self.paged.prepare_step(counts)
        except BaseException:  # out of blocks: nothing changed
            if first:
                for seq_id in seq_ids:
                    if seq_id in self.paged:
                        self.paged.free(seq_id)
            self._undo_enter(layer, q_len)
            raise
        if first:
            self._seq_ids = seq_ids
        self._seen.append(real)
        self._mask_seen = mask
        self._plan = make_plan(self._step, real, all_real, step, self.device, plan)
        return self._plan

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """transformers' mask sizes; under torch.compile the cache is named to the ``"hal"`` mask function that
        follows, which plans the forward's step there, before its layers."""
        if torch.compiler.is_compiling():
            _context.masking = self
        return super().get_mask_sizes(query_length, layer_idx)

    def _new_id(self) -> Hashable:
        self._next_id += 1
        return self._next_id - 1

    # -- row operations (beam search, contrastive search) and crop (assisted decoding) ---------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]`` (beam search), as ``DynamicCache.reorder_cache``."""
        self._take_rows(self._row_list(beam_idx, "beam_idx"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (``[a, b]`` → ``[a, a, b, b]`` for 2)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ArgumentError(f"batch_repeat_interleave: repeats must be an int >= 1, got {repeats!r}")
        if self._seq_ids is not None:
            self._take_rows([b for b in range(len(self._seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` selects (integer indices, or a boolean mask over the rows)."""
        if self._seq_ids is None:
            return
        index = torch.as_tensor(indices)
        if index.dtype == torch.bool:
            if index.shape != (len(self._seq_ids),):
                raise ArgumentError(f"batch_select_indices: a boolean indices needs shape ({len(self._seq_ids)},), "
                                    f"got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        self._take_rows(self._row_list(index, "indices"))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions of every row (``DynamicCache.crop``'s convention)."""
        try:  # an int, or a 0-d integer tensor (assisted decoding passes one)
            count = None if isinstance(tokens_to_remove, bool) else operator.index(tokens_to_remove)
        except TypeError:
            count = None
        if count is None or count > 0:
            raise ArgumentError(f"crop: tokens_to_remove must be an int <= 0 (minus the positions to drop), got "
                                f"{tokens_to_remove!r}")
        drop = -count
        if drop == 0 or self._seq_ids is None:
            return
        seen = self._seen.array
        past = seen.shape[1]
        if any(layer.length != past for layer in self._layers):
            raise RuntimeError("HalPagedCache.crop inside a forward: crop between forwards")
        keep = max(past - drop, 0)
        lengths = {s: int(seen[b, :keep].sum()) for b, s in enumerate(self._seq_ids)}
        self.paged.truncate_many(lengths)
        self._seen.keep(keep)
        self._mask_seen = None
        for layer in self._layers:
            layer.length = keep

    def reset(self) -> None:
        """Empty the cache (every sequence freed) for a new prompt or batch; the memory stays allocated."""
        for seq_id in self._seq_ids or ():
            self.paged.free(seq_id)
        self._seq_ids, self._seen, self._plan = None, Seen(), None
        self._mask_seen = None
        self._entered, self._written, self._broken = set(), set(), None
        self._ahead_pending, self._ahead_plan = None, False
        _context.current = None
        for layer in self._layers:
            layer.length = 0

    def _row_list(self, index: Any, name: str) -> list[int]:
        rows = torch.as_tensor(index).to("cpu").flatten().tolist()
        count = len(self._seq_ids) if self._seq_ids is not None else 0
        if self._seq_ids is not None and any(not 0 <= r < count for r in rows):
            raise ArgumentError(f"{name} holds a row outside 0..{count - 1}: {rows}")
        return rows

    def _take_rows(self, sources: Sequence[int]) -> None:
        """Row ``i`` becomes a copy of row ``sources[i]``: the first copy keeps the sequence, others fork it."""
        if self._seq_ids is None:
            return
        old = self._seq_ids
        new: list[Hashable] = []
        forked: list[Hashable] = []
        used: set[int] = set()
        try:
            for src in sources:
                if src in used:
                    child = self._new_id()
                    self.paged.fork(old[src], child)
                    forked.append(child)
                    new.append(child)
                else:
                    used.add(src)
                    new.append(old[src])
        except OutOfBlocksError:
            for child in forked:  # all or nothing: the forks made so far are undone
                self.paged.free(child)
            raise
        for b, seq_id in enumerate(old):
            if b not in used:
                self.paged.free(seq_id)
        self._seq_ids = new
        self._seen, self._mask_seen = Seen(self._seen.array[list(sources)]), None

    # -- lifetime ----------------------------------------------------------------

    def host_layer_ops(self, layer: int, options: Any) -> tuple[BoundOp, BoundOp]:
        """``(write_kv_cache, paged_attention)`` of a host backend's front door with layer ``layer``'s caches bound,
        and ``options`` (an :class:`~hal_core.AttentionOptions`) bound to the second: made once per layer and
        options object (:meth:`HostRoute.bind <hal_core.torch.HostRoute.bind>`)."""
        found = self._bound[layer]
        if found is None or found[0] is not options:
            caches = {"key_cache": self.paged.key_caches[layer], "value_cache": self.paged.value_caches[layer]}
            found = self._bound[layer] = (options, self.route.bind("write_kv_cache", **caches),
                                          self.route.bind("paged_attention", **caches, options=options))
        return found[1], found[2]

    def close(self) -> None:
        """Give the hal cache's memory back; the cache is empty and unusable afterwards."""
        self.reset()
        self.key_caches, self.value_caches = [], []
        self.paged.close()
