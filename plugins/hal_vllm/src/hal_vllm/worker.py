"""A vLLM worker extension that reports what hal did in the worker process.

vLLM runs the model in worker processes, so hal's counters
(:func:`hal_core.stats`) of the attention calls live there. Pass
``worker_extension_cls="hal_vllm.worker.HalWorkerExtension"`` to ``LLM(...)``
(``--worker-extension-cls`` to ``vllm serve``) and read them with
``llm.collective_rpc("hal_stats")``: one report per worker.
"""

from __future__ import annotations

import os
from typing import Any

import hal_core

__all__ = ["HalWorkerExtension"]


class HalWorkerExtension:
    """Methods vLLM adds to each of its workers (``collective_rpc`` calls them by name)."""

    def hal_stats(self) -> dict[str, Any]:
        """This worker's ``pid`` and :func:`hal_core.stats` (per backend and op: calls, implementations, fallbacks)."""
        return {"pid": os.getpid(), "stats": hal_core.stats()}
