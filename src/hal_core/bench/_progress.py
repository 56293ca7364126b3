"""A small progress bar on stderr (no dependency): redrawn in place on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``total`` steps; :meth:`step` advances one and shows ``text``."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True, width: int = 24) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, text: str) -> None:
        """Mark one more step as started, described by ``text``."""
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.monotonic() - self.start:5.0f}s {text}"
        if self._tty:
            self.stream.write("\r\x1b[2K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
