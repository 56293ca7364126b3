"""Timing: warm-up, then repeated runs until a sample count or a time cap; median, min and max."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Samples", "TimingPolicy", "measure"]


@dataclass(frozen=True)
class TimingPolicy:
    """How long to measure one function.

    ``warmup`` untimed runs, and more until ``warmup_seconds`` of them have
    passed (an op called after a pause runs slower for its first few
    milliseconds of calls while the worker threads and the machine wake up;
    a serving engine calls it continuously), then timed runs until
    ``repeat`` samples, or
    until ``max_seconds`` of timed runs have passed once ``min_repeat``
    samples exist, or until ``min_repeat * max_seconds`` have passed
    whatever the count (so a call of several seconds is timed once or
    twice, and slow cases stay bounded).
    """

    repeat: int = 10
    warmup: int = 1
    min_repeat: int = 3
    max_seconds: float = 1.0
    warmup_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError(f"argument --repeat: expected >= 1, got {self.repeat}")
        if self.warmup < 0:
            raise ValueError(f"argument --warmup: expected >= 0, got {self.warmup}")
        if self.max_seconds <= 0:
            raise ValueError(f"argument --max-time: expected > 0, got {self.max_seconds}")
        if self.warmup_seconds < 0:
            raise ValueError(f"argument --warmup-time: expected >= 0, got {self.warmup_seconds}")


@dataclass(frozen=True)
class Samples:
    """Seconds of each timed run."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.seconds))

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def as_dict(self) -> dict[str, float | int]:
        """Milliseconds: ``median_ms``, ``min_ms``, ``max_ms``, and ``samples``."""
        return {"median_ms": self.median * 1e3, "min_ms": self.min * 1e3, "max_ms": self.max * 1e3,
                "samples": len(self.seconds)}


def measure(
    fn: Callable[[int], object],
    policy: TimingPolicy,
    *,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> Samples:
    """Time ``fn(i)`` (``i`` counts calls, for rotating inputs), ``sync()`` included in each run."""
    calls = 0
    start = clock()
    while calls < policy.warmup or (policy.warmup_seconds > 0 and clock() - start < policy.warmup_seconds):
        fn(calls)
        calls += 1
        if calls >= policy.warmup:
            sync()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < policy.repeat:
        start = clock()
        fn(calls)
        sync()
        elapsed = clock() - start
        calls += 1
        samples.append(elapsed)
        spent += elapsed
        if spent >= policy.max_seconds and (len(samples) >= policy.min_repeat
                                             or spent >= policy.min_repeat * policy.max_seconds):
            break
    return Samples(tuple(samples))
