"""What every ``hal bench --model`` child shares, torch-free: its JSON lines, its memory probes and the prompts.

The prompts are drawn with numpy, so a torch-free contender (the engine)
serves the very token ids the transformers contenders do.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["AnonSampler", "emit", "peak_rss_bytes", "phase", "prompt_array", "status_bytes"]


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
