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
    model_runner: Any  # the worker's, set by vLLM

    def hal_stats(self) -> dict[str, Any]:
        """This worker's ``pid``, tensor-parallel ``rank``, the CPUs it may run on, :func:`hal_core.stats`, and
        its layers.

        ``attention`` maps each attention layer's name to ``{"impl": class name, "window": sliding window or
        None, "heads": query heads, "kv_heads": KV heads}`` (this rank's share of the heads); ``linear``
        maps each linear layer that vLLM runs through a mixed-precision kernel (GPTQ, AWQ) to that
        kernel's class name; ``moe`` maps each MoE layer to its method's name (``HalGPTQMoEMethod`` or
        ``HalAWQMoEMethod`` where hal runs it).
        """
        layers = self.vllm_config.compilation_config.static_forward_context
        attention = {}
        for name, layer in layers.items():
            impl = getattr(layer, "impl", layer)
            window = getattr(impl, "sliding_window", None)
            attention[name] = {"impl": type(impl).__qualname__, "window": window if window and window > 0 else None,
                               "heads": getattr(impl, "num_heads", None),
                               "kv_heads": getattr(impl, "num_kv_heads", None)}
        linear, moe = {}, {}
        for name, module in self.model_runner.get_model().named_modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "kernel", None)
            if kernel is not None:
                linear[name] = type(kernel).__qualname__
            if method is not None and hasattr(method, "is_monolithic"):  # a MoE layer's (FusedMoEMethodBase)
                moe[name] = method.method_name
        from vllm.distributed import get_tensor_model_parallel_rank

        return {"pid": os.getpid(), "rank": get_tensor_model_parallel_rank(), "cpus": sorted(os.sched_getaffinity(0)),
                "stats": hal_core.stats(), "attention": attention, "linear": linear, "moe": moe}
