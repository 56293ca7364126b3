"""A small serving engine on hal alone: continuous batching over a paged KV cache, no torch.

Each :meth:`Engine.step` runs one batch: one decode token for every running
request, then prompt chunks of the requests still prefilling and of newly
admitted ones, up to ``max_batch_tokens`` new tokens in all (a long prompt is
prefilled over several steps). A request whose prompt is complete samples a
token from its last row's logits. A finished request frees its cache blocks
at once. When the cache cannot hold a step's prompt chunks they wait for a
later step; running requests are never preempted, so a cache too small for
the running requests together raises :class:`~hal_core.OutOfBlocksError`
(:meth:`Engine.generate` then drops its requests, blocks freed). A request
that could never be served (its prompt plus ``max_new_tokens`` beyond
``max_position_embeddings`` or the whole cache) is refused when queued.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import get_backend
from .._backend import Backend
from .._errors import ArgumentError, OutOfBlocksError
from ..arrays import numpy_dtype
from ..kvcache import CacheConfig, PagedKVCache
from ..ops.quantized_gemm import ACTIVATIONS as GEMM_ACTIVATIONS
from ._config import ModelConfig
from ._model import DecoderModel
from ._requests import Request, SamplingParams
from ._weights import load_weights

__all__ = ["Engine"]


class Engine:
    """Serve a checkpoint (``config.json`` + safetensors) of a Llama, Mistral, Qwen3, Mixtral or Qwen3-MoE model
    (:class:`ModelConfig`) through one hal backend.

    ``bits``: 4 or 8 for the projections and experts (quantized at load, groups of
    ``group_size``), ``lm_head_bits`` for the output projection; ``dtype``:
    activations and KV cache (``"fp32"``, ``"bf16"``, ``"fp16"``);
    ``activations``: ``quantized_gemm``'s and ``fused_moe``'s activation format
    (``"int8"`` runs int4 weights as W4A8; default ``"auto"``: the op's choice per
    call). ``kv_cache_tokens``: tokens the cache holds across every running request; ``max_batch_tokens``: new tokens
    per step. ``progress`` is called with a line per loaded layer.
    """

    def __init__(self, folder: str | Path, *, backend: Backend | None = None, bits: int = 4, group_size: int = 128,
                 lm_head_bits: int = 8, dtype: str = "fp32", activations: str | None = "auto",
                 kv_cache_tokens: int = 16384, block_size: int = 16, max_batch_tokens: int = 512,
                 progress: Callable[[str], None] | None = None) -> None:
        _check_arguments(bits=bits, group_size=group_size, lm_head_bits=lm_head_bits, dtype=dtype,
                         activations=activations, kv_cache_tokens=kv_cache_tokens, block_size=block_size,
                         max_batch_tokens=max_batch_tokens)
        if backend is not None and not isinstance(backend, Backend):
            raise ArgumentError(f"argument 'backend': expected a hal_core Backend, got {type(backend).__name__}")
        if progress is not None and not callable(progress):
            raise ArgumentError(f"argument 'progress': expected a callable, got {type(progress).__name__}")
        self.backend = backend or get_backend()
        self.config = c = ModelConfig.from_pretrained(folder)
        self.stop_token_ids = c.eos_token_ids
        self.dtype = numpy_dtype(dtype)
        self.max_batch_tokens = max_batch_tokens
        self.cache = PagedKVCache(self.backend, CacheConfig(c.num_layers, c.num_kv_heads, c.head_size, block_size,
                                                            dtype), num_blocks=-(-kv_cache_tokens // block_size))
        try:  # the cache first: one too large for the device fails before any weight is read
            self.weights = load_weights(folder, c, self.backend, dtype=self.dtype, bits=bits, group_size=group_size,
                                        lm_head_bits=lm_head_bits, progress=progress)
            self.model = DecoderModel(c, self.weights, self.backend, dtype=self.dtype, activations=activations)
        except BaseException:
            self.cache.close()
            raise
        self.waiting: list[Request] = []
        self.running: list[Request] = []  #: admitted: in the cache, prefilling or decoding

    def add_request(self, request_id: Hashable, prompt: Sequence[int] | np.ndarray, *, max_new_tokens: int = 16,
                    sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] | None = None) -> None:
        """Queue a request, checked now (ArgumentError names it); ``stop_token_ids`` defaults to the config's
        ``eos_token_id``."""
        self.waiting.append(self._request(request_id, prompt, max_new_tokens, sampling, stop_token_ids))

    def _request(self, request_id: Hashable, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
                 sampling: SamplingParams | None, stop_token_ids: Sequence[int] | None) -> Request:
        """A checked request, not queued: ArgumentError names it when it could never be served."""
        try:
            hash(request_id)
        except TypeError:
            raise ArgumentError(f"argument 'request_id': {request_id!r} is not hashable") from None
        if any(r.request_id == request_id for r in (*self.waiting, *self.running)):
            raise ArgumentError(f"request {request_id!r}: already queued")
        stops = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        request = Request.make(request_id, prompt, max_new_tokens, sampling, stops, self.config.vocab_size)
        length = len(request.prompt) + request.max_new_tokens
        limits = (("max_position_embeddings", self.config.max_position_embeddings, length),
                  ("the KV cache's tokens", self.cache.num_blocks * self.cache.config.block_size, length - 1))
        for what, limit, needed in limits:
            if needed > limit:
                raise ArgumentError(f"request {request_id!r}: a prompt of {len(request.prompt)} tokens plus "
                                    f"max_new_tokens={request.max_new_tokens} needs {needed} positions, more than "
                                    f"{what} ({limit})")
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        budget = self.max_batch_tokens
        feed: dict[Hashable, np.ndarray] = {}
        members: list[Request] = []
        for r in self.running:
            if r.prefill_left == 0:
                feed[r.request_id] = np.asarray(r.output[-1:], dtype=np.int64)
                members.append(r)
                budget -= 1
        decodes = len(members)
        joining: list[Request] = []
        for r in [*[r for r in self.running if r.prefill_left], *self.waiting]:
            if budget <= 0:
                break
            n = min(r.prefill_left, budget)
            feed[r.request_id] = r.prompt[r.prefilled:r.prefilled + n]
            members.append(r)
            budget -= n
            if r in self.waiting:
                joining.append(r)
        if not feed:  # nothing queued: nothing to run
            return []
        for r in joining:
            self.cache.add(r.request_id)
        try:
            step = self.cache.prepare_step({rid: len(ids) for rid, ids in feed.items()})
        except OutOfBlocksError as exc:
            for r in joining:
                self.cache.free(r.request_id)
            if not decodes:
                _note(exc, members)
                raise
            joining, members = [], members[:decodes]
            feed = {r.request_id: feed[r.request_id] for r in members}
            try:
                step = self.cache.prepare_step({rid: len(ids) for rid, ids in feed.items()})
            except OutOfBlocksError as again:
                _note(again, members)
                raise
        for r in joining:
            self.waiting.remove(r)
            self.running.append(r)
        for r in members:
            if r.prefill_left:
                r.prefilled += len(feed[r.request_id])
        sampling = [i for i, r in enumerate(members) if r.prefill_left == 0]
        if sampling:
            rows = step.last_rows[sampling]
            logits = self.model.logits(np.concatenate(list(feed.values())), step, self.cache, rows)
            tokens = self._sample(logits, [members[i] for i in sampling])
            for i, token in zip(sampling, tokens, strict=True):
                members[i].output.append(int(token))
        else:
            self.model.logits(np.concatenate(list(feed.values())), step, self.cache, np.zeros(0, np.int64))
        finished = [r for r in members if r.prefill_left == 0 and r.finished]
        for r in finished:
            self.cache.free(r.request_id)
            self.running.remove(r)
        return finished

    def _sample(self, logits: Any, requests: list[Request]) -> np.ndarray:
        be = self.backend
        params = [r.sampling for r in requests]
        arrays = {
            "temperature": np.asarray([p.temperature for p in params], np.float32),
            "top_k": np.asarray([p.top_k for p in params], np.int32),
            "top_p": np.asarray([p.top_p for p in params], np.float32),
            "min_p": np.asarray([p.min_p for p in params], np.float32),
            "seeds": np.asarray([p.step_seed(len(r.output)) for p, r in zip(params, requests, strict=True)],
                                np.int64),
        }
        tokens = be.ops.sample(logits, **{name: be.asarray(value) for name, value in arrays.items()})
        return be.to_numpy(tokens)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                 sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] | None = None
                 ) -> list[list[int]]:
        """Serve ``prompts`` to completion (continuous batching); each prompt's new token ids, in order."""
        requests = [self._request(_Generated(n), prompt, max_new_tokens, sampling, stop_token_ids)
                    for n, prompt in enumerate(prompts)]  # every prompt checked before any is queued
        self.waiting.extend(requests)
        try:
            while any(not (r.prefill_left == 0 and r.finished) for r in requests):
                self.step()
        except BaseException:
            self._drop(requests)
            raise
        return [list(r.output) for r in requests]

    def abort(self, request_id: Hashable) -> None:
        """Remove a queued or running request, its cache blocks freed (ArgumentError when there is none)."""
        found = [r for r in (*self.waiting, *self.running) if r.request_id == request_id]
        if not found:
            raise ArgumentError(f"request {request_id!r}: not queued")
        self._drop(found)

    def _drop(self, requests: list[Request]) -> None:
        """Remove ``requests`` wherever they are, their cache blocks freed."""
        for r in requests:
            if r in self.running:
                self.running.remove(r)
                self.cache.free(r.request_id)
            elif r in self.waiting:
                self.waiting.remove(r)

    def close(self) -> None:
        """Give the KV cache's memory back."""
        self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _note(exc: BaseException, members: list[Request]) -> None:
    """Name the step's requests on ``exc`` (Python 3.11+ shows notes under the message)."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"the step's requests: {', '.join(repr(r.request_id) for r in members)} (the engine does not "
                     "preempt: abort one, or size kv_cache_tokens larger)")


class _Generated:
    """The id of one of :meth:`Engine.generate`'s prompts: equal to no other id."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"generate prompt {self.index}"


def _check_arguments(*, bits: Any, group_size: Any, lm_head_bits: Any, dtype: Any, activations: Any,
                     **positive: Any) -> None:
    """ArgumentError naming the first of :class:`Engine`'s arguments out of range (nothing is read yet)."""
    for name, value in (("bits", bits), ("lm_head_bits", lm_head_bits)):
        if value not in (4, 8) or isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentError(f"argument {name!r}: expected 4 or 8, got {value!r}")
    for name, value in (("group_size", group_size), *positive.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"argument {name!r}: expected a positive integer, got {value!r}")
    if dtype not in ("fp32", "fp16", "bf16"):
        raise ArgumentError(f"argument 'dtype': expected 'fp32', 'fp16' or 'bf16', got {dtype!r}")
    if activations is not None and activations not in GEMM_ACTIVATIONS:
        raise ArgumentError(f"argument 'activations': expected None or one of {', '.join(GEMM_ACTIVATIONS)}, "
                            f"got {activations!r}")
