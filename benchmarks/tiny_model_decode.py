"""Decode-step time of the ``tiny`` bench model: plain transformers (``sdpa``) against ``attn_implementation="hal"``.

The model is ``hal bench --model tiny``'s (2 layers, random weights), fp32,
on the host (or ``--device cuda``). After one prefill of ``--prompt``
tokens per sequence, each decode step is one forward of one token per
sequence with the whole attention mask, as ``generate()`` makes it. Besides
the per-step figures, the hal side is split per layer call: the time spent
in hal's two ops (``write_kv_cache`` and ``paged_attention``, front door and
kernel), the glue of the transformers backend (the cache's ``update`` and
the attention function, without the planning) — what the backend adds over
the kernels per layer — and, per forward, the step's planning (made once,
by the first layer's call). A last figure runs only the layers' ``update``
and the attention function in a tight loop, hal's ops replaced by ones that
do nothing: the backend's own cost per forward, free of the model's effect
on the caches.

Every figure is a median over ``--repeats`` runs of ``--steps`` steps,
sides interleaved, torch on one thread. The step is given as wall time and
as the calling thread's CPU time (``time.thread_time``: on a shared machine
the time the scheduler gives other processes is not counted, nor the time
hal-cpu's pool workers spin between jobs, which ``time.process_time`` would
add to whatever runs next); the per-call split is thread CPU time. Set
``HAL_CPU_THREADS=1`` to run hal's kernels on the calling thread only, so
that the thread time holds all of their work. On a device the CPU time is
what the host spends launching (the device works asynchronously).

Usage: ``python benchmarks/tiny_model_decode.py [--batch B] [--prompt N] [--steps S] [--repeats R] [--device D]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hal_core.bench._model_spec import BUILTIN_MODELS
from hal_core.bench._model_worker import build_float_model, prompt_ids
from hal_core.torch import transformers as hal_hf


class _Clock:
    """Accumulated thread CPU time of wrapped calls (re-entrant calls counted once)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.thread_time() if self._depth == 1 else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                if self._depth == 1:
                    self.total += time.thread_time() - start
                    self.calls += 1
                self._depth -= 1
        return timed


class _TimedOps:
    """A front door whose ``write_kv_cache`` and ``paged_attention`` (called, or bound) are timed on ``clock``."""

    def __init__(self, ops: Any, clock: _Clock) -> None:
        self._ops, self._clock = ops, clock
        self.write_kv_cache = clock.wrap(ops.write_kv_cache)
        self.paged_attention = clock.wrap(ops.paged_attention)

    def bind(self, op: str, **fixed: Any) -> Any:
        """The cache's layers bind their two ops (``Ops.bind``): the bound op, timed."""
        bound = self._ops.bind(op, **fixed)
        return self._clock.wrap(bound) if op in ("write_kv_cache", "paged_attention") else bound

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def _decode(model: torch.nn.Module, cache: Any, ids: torch.Tensor, steps: int,
            clocks: tuple[_Clock, ...] = ()) -> tuple[float, float]:
    """Seconds per decode step (wall, thread CPU) after a prefill of ``ids`` into ``cache`` (``clocks`` zeroed
    after it)."""
    batch, length = ids.shape
    mask = torch.ones(batch, length, dtype=torch.long, device=ids.device)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1)
        sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
        sync()
        for clock in clocks:
            clock.total, clock.calls = 0.0, 0
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1)
        sync()
        return (time.perf_counter() - start) / steps, (time.thread_time() - cpu) / steps


class _NoOps:
    """A front door whose two ops do nothing: what is left of a layer call is the backend's own work."""

    def write_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        return None

    def paged_attention(self, *args: Any, **kwargs: Any) -> None:
        return None

    def bind(self, op: str, **fixed: Any) -> Any:
        """What the cache's layers bind (``Ops.bind``): the op itself, doing nothing."""
        return getattr(self, op)


def _tight_glue(model: torch.nn.Module, batch: int, steps: int, device: torch.device) -> float:
    """Thread CPU seconds of one decode forward's attention glue, every layer, hal's ops doing nothing.

    Only the layers' ``update`` and the attention function run, in a tight loop
    (no projections, no kernels), the mask growing by one column per step as in
    ``generate()``: the backend's cost per forward, planning included.
    """
    text = model.config
    attention = model.model.layers[0].self_attn
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = text.num_hidden_layers
    cache = hal_hf.HalPagedCache(text, num_blocks=batch * (steps // 16 + 2), dtype=torch.float32, device=device)
    backend, stubbed = cache.paged.backend, (hal_hf.write_kv_cache, hal_hf.paged_attention)
    real_ops = backend.ops
    backend.bind_ops(_NoOps())  # type: ignore[arg-type]
    hal_hf.write_kv_cache = hal_hf.paged_attention = lambda *a, **k: torch.empty(batch, heads, head_size,
                                                                                 device=device)
    query = torch.randn(batch, 1, heads, head_size, device=device).transpose(1, 2)
    key = torch.randn(batch, 1, kv_heads, head_size, device=device).transpose(1, 2)
    value = torch.randn(batch, 1, kv_heads, head_size, device=device).transpose(1, 2)
    masks = [torch.ones(batch, t + 1, dtype=torch.long, device=device) for t in range(steps)]
    try:
        with torch.no_grad():
            start = time.thread_time()
            for mask in masks:
                for layer in range(layers):
                    k, v = cache.layers[layer].update(key, value)
                    hal_hf.hal_attention_forward(attention, query, k, v, mask, scaling=head_size ** -0.5)
            return (time.thread_time() - start) / steps
    finally:
        backend.bind_ops(real_ops)
        hal_hf.write_kv_cache, hal_hf.paged_attention = stubbed
        cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    config = BUILTIN_MODELS["tiny"]
    models = {name: build_float_model(config, torch.float32, 0, name).to(device) for name in ("sdpa", "hal")}
    ids = prompt_ids(config["vocab_size"], args.batch, args.prompt, 0).to(device)
    blocks = args.batch * -(-(args.prompt + args.steps + 1) // 16)
    layers = config["num_hidden_layers"]

    tight = statistics.median(_tight_glue(models["hal"], args.batch, 1024, device) for _ in range(args.repeats))
    glue, ops, plan = _Clock(), _Clock(), _Clock()
    hal_hf.AttentionInterface.register("hal", glue.wrap(hal_hf.hal_attention_forward))
    enter, plan_for = hal_hf.HalPagedCache._enter_layer, hal_hf.HalPagedCache._plan_for
    hal_hf.HalPagedCache._enter_layer = glue.wrap(enter)  # type: ignore[method-assign]
    hal_hf.HalPagedCache._plan_for = plan.wrap(plan_for)  # type: ignore[method-assign]
    timed_ops = [hal_hf.write_kv_cache, hal_hf.paged_attention]

    names = ("sdpa", "hal", "sdpa_cpu", "hal_cpu", "glue", "ops", "plan")
    figures: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        wall, cpu = _decode(models["sdpa"], None, ids, args.steps)
        figures["sdpa"].append(wall)
        figures["sdpa_cpu"].append(cpu)
        cache = hal_hf.HalPagedCache(models["hal"].config, num_blocks=blocks, dtype=torch.float32, device=device)
        backend = cache.paged.backend
        backend.bind_ops(_TimedOps(backend.ops, ops))
        hal_hf.write_kv_cache, hal_hf.paged_attention = (ops.wrap(op) for op in timed_ops)
        try:
            _decode(models["hal"], cache, ids, 1)  # the prefill and one step: not counted
            cache.reset()
            wall, cpu = _decode(models["hal"], cache, ids, args.steps, (glue, ops, plan))
            figures["hal"].append(wall)
            figures["hal_cpu"].append(cpu)
        finally:
            backend.bind_ops(backend.ops._ops)
            hal_hf.write_kv_cache, hal_hf.paged_attention = timed_ops
            cache.close()
        calls = args.steps * layers
        figures["glue"].append((glue.total - ops.total - plan.total) / calls)
        figures["plan"].append(plan.total / args.steps)
        figures["ops"].append(ops.total / calls)

    us = {name: statistics.median(values) * 1e6 for name, values in figures.items()}
    print(f"tiny model, fp32, {device}, batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, "
          f"median of {args.repeats}; load average {os.getloadavg()[0]:.2f}")
    for label, key in (("wall", ""), ("thread CPU", "_cpu")):
        sdpa, hal = us["sdpa" + key], us["hal" + key]
        print(f"  decode step, {label:10s}  sdpa {sdpa:8.1f} us   hal {hal:8.1f} us   sdpa/hal speed {sdpa / hal:.2f}")
    print(f"  per hal layer call: ops (front door + kernels) {us['ops']:7.1f} us; the backend's glue (update, "
          f"attention function) {us['glue']:6.1f} us")
    print(f"  per forward: the step's planning (mask check, slots, block tables, lengths) {us['plan']:6.1f} us")
    print(f"  tight loop, hal's ops doing nothing: the backend's whole cost per forward of {layers} layers "
          f"{tight * 1e6:6.1f} us ({tight * 1e6 / layers:5.1f} us per layer call, planning included)")


if __name__ == "__main__":
    main()
