"""What every ``hal bench --model`` child shares, torch-free: its JSON lines, its memory probes and the prompts.

The prompts are drawn with numpy, so a torch-free contender (the engine)
serves the very token ids the transformers contenders do.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["AnonSampler", "emit", "peak_rss_bytes", "phase", "prompt_array", "status_bytes", "timed_rounds"]


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout (the parent reads them as they come)."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def phase(text: str) -> None:
    """A progress line."""
    emit("phase", text=text)


# -- memory -------------------------------------------------------------------------


def status_bytes(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes (empty where there is no procfs)."""
    found = {}
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name in keys:
                    found[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory: ``VmHWM``, else ``ru_maxrss``.

    ``VmHWM`` belongs to the process's own address space; Linux's
    ``ru_maxrss`` also keeps the parent's high-water mark across fork and
    exec, so a child would inherit the parent's peak.
    """
    found = status_bytes("VmHWM")
    if "VmHWM" in found:
        return found["VmHWM"]
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class AnonSampler:
    """The largest anonymous resident memory (``RssAnon``: not file pages) seen every ``interval`` seconds."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        now = status_bytes("RssAnon").get("RssAnon", 0)
        self.peak = max(self.peak, now)
        return now

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def prompt_array(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    """The prompts: ``[batch, length]`` int64 token ids drawn uniformly from a generator seeded with ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64)


def timed_rounds(task: dict[str, Any], name: str, sampler: AnonSampler,
                 greedy: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """``task["repeat"]`` rounds of ``greedy(batch)`` (a prefill and ``new_tokens`` decode steps of the first
    ``batch`` prompts) at every batch size; the result's ``prefill``, ``ttft_s``, ``decode`` and ``tokens``
    fields, and ``peak_after_batch`` (the high-water marks once each batch size has run, the first round's)."""
    prompt_len, new_tokens, batches = task["prompt_len"], task["new_tokens"], task["batches"]
    prefill_s: list[float] = []
    first_s: list[float] = []
    tokens: dict[str, Any] = {}
    by_batch: dict[str, dict[str, int]] = {}
    decode: dict[str, list[float]] = {str(b): [] for b in batches}
    steps: dict[str, list[float]] = {str(b): [] for b in batches}
    for rnd in range(task["repeat"]):
        for batch in sorted(set(batches) | {1}):
            phase(f"{name}: round {rnd + 1}/{task['repeat']}, batch {batch}: prefill {batch}x{prompt_len}, "
                  f"decode {new_tokens}")
            got = greedy(batch)
            if batch == 1:
                prefill_s.append(got["prefill_s"])
                first_s.append(got["first_s"])
            if str(batch) in decode:
                decode[str(batch)].append(sum(got["step_s"]))
                steps[str(batch)] += got["step_s"]
            tokens[str(batch)] = got["tokens"]
            by_batch.setdefault(str(batch), {"peak_rss_bytes": peak_rss_bytes(), "peak_anon_bytes": sampler.peak})
    return {
        "prefill": {"seconds": prefill_s, "tokens_per_s": prompt_len / float(np.median(prefill_s))},
        "ttft_s": float(np.median(first_s)),
        "decode": {b: {"seconds": decode[b], "tokens_per_s": int(b) * new_tokens / float(np.median(decode[b])),
                       "step_ms_median": 1e3 * float(np.median(steps[b])),
                       "step_ms_min": 1e3 * float(np.min(steps[b]))} for b in decode},
        "tokens": tokens, "peak_after_batch": by_batch,
    }
