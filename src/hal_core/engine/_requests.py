"""What a request asks of the engine: its prompt, how many tokens, how to sample them, when to stop."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import ArgumentError

__all__ = ["Request", "SamplingParams"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are drawn (the ``sample`` op's per-sequence parameters).

    ``temperature`` 0 is greedy (argmax). ``top_k`` 0 and ``top_p`` 1 and
    ``min_p`` 0 are off. ``seed`` makes a request's tokens reproducible: step
    ``n`` of the request draws with a seed derived from ``(seed, n)``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ArgumentError(f"argument 'temperature': expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ArgumentError(f"argument 'top_k': expected >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ArgumentError(f"argument 'top_p': expected in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ArgumentError(f"argument 'min_p': expected in [0, 1], got {self.min_p}")

    def step_seed(self, n: int) -> int:
        """The ``sample`` op's seed for the request's ``n``-th generated token (a signed int64)."""
        value = (self.seed * 0x9E3779B97F4A7C15 + n + 1) & _MASK64
        return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class Request:
    """One sequence: ``prompt`` token ids, up to ``max_new_tokens`` new ones, stopping at ``stop_token_ids``."""

    request_id: Hashable
    prompt: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  #: prompt tokens already in the cache

    @classmethod
    def make(cls, request_id: Hashable, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
             sampling: SamplingParams | None, stop_token_ids: Sequence[int], vocab_size: int) -> Request:
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ArgumentError(f"request {request_id!r}: the prompt must be a non-empty sequence of token ids")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ArgumentError(f"request {request_id!r}: token ids must be in [0, {vocab_size}), "
                                f"got {int(ids.min())}..{int(ids.max())}")
        if max_new_tokens < 1:
            raise ArgumentError(f"argument 'max_new_tokens': expected >= 1, got {max_new_tokens}")
        return cls(request_id, ids.astype(np.int64), int(max_new_tokens), sampling or SamplingParams(),
                   frozenset(int(t) for t in stop_token_ids))

    @property
    def prefill_left(self) -> int:
        return len(self.prompt) - self.prefilled

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens or bool(self.output and self.output[-1] in self.stop_token_ids)
