"""The child process of ``hal bench --model`` for the ``engine`` contender: :mod:`hal_core.engine`, no torch.

Run as ``python -m hal_core.bench._engine_worker '<json task>'`` (the parent
picks it for a contender whose ``attention`` is ``"engine"``); it writes the
same JSON lines and result keys as :mod:`._model_worker`: the engine loads
the contender's GPTQ checkpoint (the lm_head quantized at load), warms up,
then times a batch's prefill (one step: every prompt whole, each sequence's
first token sampled) and each greedy decode step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from ._worker_common import AnonSampler, emit, peak_rss_bytes, phase, prompt_array, timed_rounds

__all__ = ["greedy", "main", "run"]

_WARMUP_PROMPT = 16
_BLOCK = 16  #: the KV cache's block size: each sequence holds whole blocks


def greedy(engine: Any, prompts: np.ndarray, new_tokens: int) -> dict[str, Any]:
    """Prefill ``prompts [batch, length]`` in one step (first tokens sampled), then ``new_tokens`` decode steps."""
    batch = prompts.shape[0]
    for row in range(batch):
        engine.add_request(("bench", row), prompts[row], max_new_tokens=new_tokens + 1, stop_token_ids=())
    requests = list(engine.waiting)
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter() - start
    steps = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return {"prefill_s": first, "first_s": first, "step_s": steps, "tokens": [r.output for r in requests]}


def run(task: dict[str, Any]) -> dict[str, Any]:
    """One contender: load, warm up, then ``repeat`` rounds of prefill + decode at every batch size."""
    from .. import get_backend
    from ..engine import Engine

    contender = task["contender"]
    name = contender["name"]
    prompt_len, new_tokens, batches = task["prompt_len"], task["new_tokens"], task["batches"]
    prompts = prompt_array(task["config"]["vocab_size"], max(batches), prompt_len, task["seed"] + 1)
    dtype = contender["dtype"]
    with AnonSampler() as sampler:
        phase(f"{name}: loading")
        start = time.perf_counter()
        engine = Engine(task["checkpoint"], backend=get_backend("cpu"), bits=contender["bits"],
                        group_size=task["group_size"], dtype=dtype, activations=contender.get("activations"),
                        kv_cache_tokens=max(batches) * _BLOCK * -(-(prompt_len + new_tokens + 2) // _BLOCK),
                        block_size=_BLOCK,
                        max_batch_tokens=max(batches) * prompt_len)
        load_s = time.perf_counter() - start
        loaded = {"load_peak_rss_bytes": peak_rss_bytes(), "load_peak_anon_bytes": sampler.peak,
                  "after_load_anon_bytes": sampler.sample()}
        phase(f"{name}: warming up")
        for batch in sorted(set(batches) | {1}):
            greedy(engine, prompts[:batch, :_WARMUP_PROMPT], 2)
        timed = timed_rounds(task, name, sampler, lambda b: greedy(engine, prompts[:b], new_tokens))
    memory = {"peak_rss_bytes": peak_rss_bytes(), "peak_anon_bytes": sampler.peak, **loaded,
              "peak_after_batch": timed.pop("peak_after_batch")}
    threads = int(os.environ.get("HAL_CPU_THREADS", "0") or 0) or task["threads"]
    return {
        "contender": name, "threads": threads, "load_s": load_s, "model_bytes": engine.weights.nbytes(),
        "quantized_layers": engine.weights.quantized_count(),
        **timed, "memory": memory,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the JSON task given as the one argument; exit status 0 with a ``result`` line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hal_core.bench._engine_worker '<json task>'", file=sys.stderr)
        return 2
    task = json.loads(args[0])
    emit("result", **run(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
