"""A vLLM worker extension that reports what hal did in the worker process.

vLLM runs the model in worker processes, so hal's counters
(:func:`hal_core.stats`) of the attention calls live there. Pass
``worker_extension_cls="hal_vllm.worker.HalWorkerExtension"`` to ``LLM(...)``
(``--worker-extension-cls`` to ``vllm serve``) and call its methods by name
with ``llm.collective_rpc("hal_stats")``: one answer per worker.
"""

from __future__ import annotations

import os
from typing import Any

import hal_core

__all__ = ["HalWorkerExtension"]


class HalWorkerExtension:
    """Methods vLLM adds to each of its workers (``collective_rpc`` calls them by name)."""

    vllm_config: Any  # the worker's, set by vLLM

    def hal_stats(self) -> dict[str, Any]:
        """This worker's ``pid``, the CPUs it may run on, :func:`hal_core.stats`, and its attention layers.

        ``attention`` maps each layer's name to ``{"impl": class name, "window": sliding window or None}``.
        """
        layers = self.vllm_config.compilation_config.static_forward_context
        attention = {}
        for name, layer in layers.items():
            impl = getattr(layer, "impl", layer)
            window = getattr(impl, "sliding_window", None)
            attention[name] = {"impl": type(impl).__qualname__, "window": window if window and window > 0 else None}
        return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "stats": hal_core.stats(),
                "attention": attention}
