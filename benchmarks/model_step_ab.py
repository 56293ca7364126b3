"""Decode steps of one quantized checkpoint in several torch setups, alternated step by step: plain, kernelize.

A contender of ``hal bench --model`` runs in its own process after the
previous one: on a machine whose memory bandwidth drifts between minutes,
two contenders a few percent apart swap places from run to run. This script
loads the same GPTQ checkpoint once per variant into one process, prefills
each with the same prompt, then runs decode steps in turns (one step of
each variant, then the next), so every variant sees the same machine state;
a second round is the one timed. Variants:

- ``plain``: :func:`hal_core.torch.load_quantized` as it loads (hal
  attention with :class:`~hal_core.torch.transformers.HalPagedCache`, hal's
  ``QuantLinear``);
- ``kernelize``: then :func:`hal_core.torch.kernelize` (norms, MLP
  activation and rotary on hal's ops; q/k/v and gate/up one GEMM each;
  each decoder layer's eager step as its hal calls);
- ``kernelize-torch``: as ``kernelize``, with each decoder layer's calls made on
  torch tensors (its lean forward's numpy lane off);
- ``kernelize-modules``: as ``kernelize``, with each decoder layer run module
  by module (its lean forward removed);
- ``kernelize-nofuse``: :func:`~hal_core.torch.kernelize` with ``fuse=False``.

``--checkpoint DIR`` names a GPTQ checkpoint (``hal bench --model``'s
preparation writes one: ``python -m hal_core.bench._model_worker``'s
``prepare`` task); without it the ``1b`` bench model is built and
quantized into a temporary folder first (about a minute). Reports the
median step (wall time) of each variant and its ratio to the first; greedy
tokens of every variant against the first's. ``--json PATH`` writes it with
the date, commit and machine. Run it through the quiet wrapper.

Usage: ``python benchmarks/model_step_ab.py [--checkpoint DIR] [--variants plain,kernelize,...] [--steps N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hal_core.bench import resolve_model
from hal_core.bench._machine import git_commit, machine_info, versions
from hal_core.bench._model_worker import _new_cache, prepare, prompt_ids

VARIANTS = ("plain", "kernelize", "kernelize-torch", "kernelize-modules", "kernelize-nofuse")


def _model(checkpoint: str, variant: str) -> Any:
    from hal_core.torch import kernelize, load_quantized

    model = load_quantized(checkpoint, dtype=torch.bfloat16, attn_implementation="hal")
    if variant != "plain":
        kernelize(model, fuse=variant != "kernelize-nofuse")
    if variant == "kernelize-modules":  # fused, but each decoder layer module by module (no lean forward)
        for layer in model.model.layers:
            layer.__dict__.pop("forward", None)
    if variant == "kernelize-torch":  # the lean forward's calls on torch tensors
        for layer in model.model.layers:
            layer.forward.numpy_lane = False
    return model


def run(checkpoint: str, variants: list[str], prompt: int, steps: int, vocab: int) -> dict[str, Any]:
    """Per variant: the timed round's step times, median, and its greedy tokens."""
    models = [_model(checkpoint, v) for v in variants]
    ids = prompt_ids(vocab, 1, prompt, 1)
    times: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {}
    with torch.no_grad():
        for timed in (False, True):
            state = []
            for model in models:
                cache = _new_cache(model, "hal", 1, prompt + steps + 2)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                state.append([cache, out.logits[:, -1].argmax(-1), []])
            for _ in range(steps):
                for variant, model, st in zip(variants, models, state, strict=True):
                    start = time.perf_counter()
                    out = model(input_ids=st[1][:, None], past_key_values=st[0], use_cache=True)
                    st[1] = out.logits[:, -1].argmax(-1)
                    if timed:
                        times[variant].append(time.perf_counter() - start)
                    st[2].append(int(st[1][0]))
            for variant, st in zip(variants, state, strict=True):
                st[0].close()
                tokens[variant] = st[2]
    base = statistics.median(times[variants[0]])
    return {v: {"step_ms": [t * 1e3 for t in times[v]], "median_ms": statistics.median(times[v]) * 1e3,
                "speedup": base / statistics.median(times[v]), "tokens": tokens[v],
                "tokens_equal_first": tokens[v] == tokens[variants[0]]} for v in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a GPTQ checkpoint folder (default: build the 1b model's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per variant and round (default 48)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the record as JSON")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"argument --variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    if args.steps < 4 or args.prompt < 1:
        parser.error("arguments --steps / --prompt: at least 4 steps and 1 prompt token")
    torch.set_num_threads(args.threads)
    spec = resolve_model("1b")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            print("building and quantizing the 1b model (about a minute)...", flush=True)
            checkpoint = prepare({"task": "prepare", "config": spec.config, "seed": 0, "bits": [4],
                                  "group_size": 128, "out": tmp})["checkpoints"]["4"]
        results = run(checkpoint, variants, args.prompt, args.steps, int(spec.config["vocab_size"]))
    for variant, r in results.items():
        print(f"{variant:18s} {r['median_ms']:7.2f} ms a step ({1e3 / r['median_ms']:5.1f} tokens/s)  "
              f"x{r['speedup']:.3f} vs {variants[0]}  tokens equal {variants[0]}'s: {r['tokens_equal_first']}")
    if args.json:
        record = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_commit(), "machine": machine_info(),
                  "versions": versions(), "command": ["benchmarks/model_step_ab.py", *sys.argv[1:]],
                  "settings": {"variants": variants, "prompt": args.prompt, "steps": args.steps,
                               "threads": args.threads, "checkpoint": args.checkpoint or "1b, built"},
                  "results": results}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
