"""What a request asks of the engine: its prompt, how many tokens, how to sample them, when to stop."""

from __future__ import annotations

import math
import numbers
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
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ArgumentError(f"argument {name!r}: expected a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name, bound in (("top_k", 2**31), ("seed", 2**64)):
            value = getattr(self, name)
            if not _is_int(value) or not -bound <= value < bound:
                raise ArgumentError(f"argument {name!r}: expected an integer in [-2**{bound.bit_length() - 1}, "
                                    f"2**{bound.bit_length() - 1}), got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.temperature < 0:
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
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ArgumentError(f"request {request_id!r}: argument 'max_new_tokens': expected an integer >= 1, "
                                f"got {max_new_tokens!r}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ArgumentError(f"request {request_id!r}: argument 'sampling': expected SamplingParams, "
                                f"got {type(sampling).__name__}")
        stops = np.asarray(stop_token_ids)
        if stops.ndim != 1 or (stops.size and not np.issubdtype(stops.dtype, np.integer)):
            raise ArgumentError(f"request {request_id!r}: argument 'stop_token_ids': expected a sequence of token "
                                f"ids, got {stop_token_ids!r}")
        return cls(request_id, ids.astype(np.int64), int(max_new_tokens), sampling or SamplingParams(),
                   frozenset(int(t) for t in stops))

    @property
    def prefill_left(self) -> int:
        return len(self.prompt) - self.prefilled

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens or bool(self.output and self.output[-1] in self.stop_token_ids)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
