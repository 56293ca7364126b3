"""``hal bench --model``: tokens/s, time to first token and peak memory of a whole model, per contender, in one run.

The parent measures the copy bandwidth (before and after the contenders; the
better is kept), writes the quantized checkpoints once (a ``prepare`` child,
when an int4/int8 contender runs), then runs each contender in its own child
process (:mod:`._model_worker`) and reads its JSON result. Each contender's
decode tokens/s is set against its decode limit: its own bytes per step
(:func:`._model_spec.decode_bytes`) over the copy bandwidth. Keys of the
report: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._limits import measure_copy
from ._machine import git_commit, machine_info, utc_now, versions
from ._model_spec import Contender, ModelSpec, check_sizes, decode_bytes, decode_limit
from ._progress import Progress
from ._timing import TimingPolicy

__all__ = ["MODEL_SCHEMA", "ModelBenchSettings", "format_model_table", "model_steps", "model_targets",
           "run_model_bench"]

#: The ``schema`` field of a model report.
MODEL_SCHEMA = "hal-bench-model/1"

#: Progress lines a ``prepare`` child writes per quantized width while quantizing (kept in step with the worker).
_QUARTERS = 4


@dataclass(frozen=True)
class ModelBenchSettings:
    """What a model run depends on: the model, the contenders, the prompt and decode lengths, the batches.

    ``repeat``: timed rounds per contender (each: a prefill at batch 1 and a
    decode at every batch size); ``threads``: torch's intra-op threads in
    every child (default: every core); ``group_size``: the quantized
    checkpoints' group; ``copy_bytes``: the buffer of the copy-bandwidth
    measurement (``--quick``: 32 MiB).
    """

    model: ModelSpec
    contenders: tuple[Contender, ...]
    prompt_len: int = 512
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 8)
    repeat: int = 1
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    seed: int = 0
    group_size: int = 128
    copy_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        from ._cases import BenchArgumentError

        for name, value in (("--prompt-len", self.prompt_len), ("--new-tokens", self.new_tokens),
                            ("--repeat", self.repeat), ("--threads", self.threads)):
            if value < 1:
                raise BenchArgumentError(f"argument {name}: expected >= 1, got {value}")
        if not self.batches or min(self.batches) < 1:
            raise BenchArgumentError(f"argument --batches: expected batch sizes >= 1, got {list(self.batches)}")
        if not self.contenders:
            raise BenchArgumentError("argument --contenders: no contender to run")
        limit = self.model.config.get("max_position_embeddings")
        if isinstance(limit, int) and self.prompt_len + self.new_tokens + 1 > limit:
            raise BenchArgumentError(f"argument --prompt-len: {self.prompt_len} + {self.new_tokens} new tokens "
                                     f"exceed the model's max_position_embeddings={limit}")
        check_sizes(self.model, self.contenders, self.group_size)


def model_steps(settings: ModelBenchSettings) -> int:
    """Progress steps of a run: the bandwidth twice, the preparation, and each contender's phases."""
    phases = 2 + settings.repeat * len(set(settings.batches) | {1})
    widths = len({c.bits for c in settings.contenders if c.bits})
    prepare = 2 + widths * (_QUARTERS + 1) if widths else 0
    return 2 + prepare + len(settings.contenders) * phases


class _ChildFailed(RuntimeError):
    pass


def _child(task: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any]:
    """Run one worker task in a fresh interpreter; its phases advance ``step``; its ``result`` line is returned."""
    engine = task.get("contender", {}).get("attention") == "engine"
    worker = "hal_core.bench._engine_worker" if engine else "hal_core.bench._model_worker"
    command = [sys.executable, "-m", worker, json.dumps(task)]
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        result = None
        assert process.stdout is not None
        for line in process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "phase":
                step(event["text"])
            elif event.get("event") == "result":
                result = event
        status = process.wait()
        if status != 0 or result is None:
            errors.seek(0)
            tail = errors.read().strip().splitlines()[-6:]
            raise _ChildFailed(f"exit status {status}: " + " | ".join(tail))
    result.pop("event")
    return result


def _copy(nbytes: int, step: Callable[[str], None]) -> dict[str, Any]:
    import hal_core

    step("copy bandwidth")
    backend = hal_core.get_backend("cpu")
    policy = TimingPolicy(repeat=10, warmup=1, min_repeat=3, max_seconds=1.0, warmup_seconds=0.25)
    return measure_copy(backend, nbytes, policy, lambda: None)


def _ratios(settings: ModelBenchSettings, copy_gbps: float, results: dict[str, dict[str, Any]]) -> None:
    """Add each contender's decode limit and its fraction of it (in place)."""
    for contender in settings.contenders:
        result = results.get(contender.name)
        if result is None or "error" in result:
            continue
        for batch, entry in result["decode"].items():
            b = int(batch)
            entry["bytes"] = decode_bytes(settings.model, contender, b, settings.prompt_len, settings.new_tokens,
                                          settings.group_size)
            entry["limit_tokens_per_s"] = decode_limit(settings.model, contender, b, settings.prompt_len,
                                                       settings.new_tokens, copy_gbps, settings.group_size)
            entry["ratio_limit"] = entry["tokens_per_s"] / entry["limit_tokens_per_s"]


def _get(results: dict[str, dict[str, Any]], name: str, *path: str) -> float | None:
    value: Any = results.get(name)
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


def model_targets(results: dict[str, dict[str, Any]], batches: Sequence[int]) -> list[dict[str, Any]]:
    """The ratios docs/benchmarks.md sets targets for, each with its target and whether it is met (None: the
    contenders it needs did not run)."""
    big = str(max(batches))
    scaling = _get(results, "hal-int4", "decode", big, "tokens_per_s") if big != "1" else None
    pairs = [
        ("int4 decode batch 1 / its decode limit",
         _get(results, "hal-int4", "decode", "1", "ratio_limit"), 1.0, 0.6),
        ("int4 decode batch 1 / sdpa bf16 decode batch 1",
         _get(results, "hal-int4", "decode", "1", "tokens_per_s"),
         _get(results, "sdpa-bf16", "decode", "1", "tokens_per_s"), 2.5),
        (f"int4 decode batch {big} / int4 decode batch 1",  # not run without a batch above 1
         scaling, _get(results, "hal-int4", "decode", "1", "tokens_per_s"), 3.0),
        ("int4 prefill / sdpa bf16 prefill",
         _get(results, "hal-int4", "prefill", "tokens_per_s"), _get(results, "sdpa-bf16", "prefill", "tokens_per_s"),
         1.0),
        ("sdpa fp32 peak memory / int4 peak memory (target: int4 <= 0.3x fp32)",
         _get(results, "sdpa-fp32", "memory", "peak_rss_bytes"), _get(results, "hal-int4", "memory", "peak_rss_bytes"),
         1 / 0.3),
        ("int4 with kernelize() decode batch 1 / int4 decode batch 1",
         _get(results, "hal-int4-k", "decode", "1", "tokens_per_s"), _get(results, "hal-int4", "decode", "1",
                                                                          "tokens_per_s"), 1.0),
        ("engine int4 decode batch 1 / transformers int4 decode batch 1",
         _get(results, "engine-int4", "decode", "1", "tokens_per_s"),
         max(filter(None, (_get(results, name, "decode", "1", "tokens_per_s")
                           for name in ("hal-int4", "hal-int4-k", "hal-int4-c"))), default=None), 1.0),
        ("int4 compiled decode batch 1 / int4 decode batch 1",
         _get(results, "hal-int4-c", "decode", "1", "tokens_per_s"), _get(results, "hal-int4", "decode", "1",
                                                                          "tokens_per_s"), 1.0),
    ]
    out = []
    for label, top, bottom, target in pairs:
        ratio = None if top is None or bottom is None or not bottom else top / bottom
        met = None if ratio is None else ratio >= target
        out.append({"ratio": label, "value": ratio, "target": target, "met": met})
    return out


def run_model_bench(settings: ModelBenchSettings, *, progress: Progress | None = None,
                    argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every contender of ``settings`` and return the report (a JSON-ready dict; keys in docs/benchmarks.md).

    A contender whose child fails is reported with its ``error`` (the last
    lines of its stderr); the others run.
    """
    bar = progress or Progress(model_steps(settings), enabled=False)
    started = time.monotonic()
    copies = [_copy(settings.copy_bytes, bar.step)]
    results: dict[str, dict[str, Any]] = {}
    base = {"config": dict(settings.model.config), "seed": settings.seed, "group_size": settings.group_size}
    with tempfile.TemporaryDirectory(prefix="hal-bench-model-") as folder:
        checkpoints: dict[str, str] = {}
        widths = sorted({c.bits for c in settings.contenders if c.bits})
        if widths:
            bar.step(f"writing the int{'/int'.join(map(str, widths))} checkpoints")
            try:
                checkpoints = _child({**base, "task": "prepare", "bits": widths, "out": folder},
                                     bar.step)["checkpoints"]
            except _ChildFailed as exc:
                for c in settings.contenders:
                    if c.bits:
                        results[c.name] = {"contender": c.name, "error": f"preparing the checkpoint: {exc}"}
        for contender in settings.contenders:
            if contender.name in results:
                continue
            task = {**base, "task": "run", "contender": dataclasses.asdict(contender),
                    "prompt_len": settings.prompt_len, "new_tokens": settings.new_tokens,
                    "batches": list(settings.batches), "repeat": settings.repeat,
                    "threads": settings.threads, "checkpoint": checkpoints.get(str(contender.bits))}
            try:
                results[contender.name] = _child(task, bar.step)
            except _ChildFailed as exc:
                results[contender.name] = {"contender": contender.name, "error": str(exc)}
    copies.append(_copy(settings.copy_bytes, bar.step))
    bar.close()
    copy = max(copies, key=lambda c: c["gbps"])
    _ratios(settings, copy["gbps"], results)
    return {
        "schema": MODEL_SCHEMA, "date": utc_now(), "git": git_commit(),
        "command": list(argv) if argv is not None else None, "machine": machine_info(), "versions": versions(),
        "model": {**settings.model.summary(), "config": dict(settings.model.config)},
        "settings": {"prompt_len": settings.prompt_len, "new_tokens": settings.new_tokens,
                     "batches": list(settings.batches), "repeat": settings.repeat, "threads": settings.threads,
                     "seed": settings.seed, "group_size": settings.group_size,
                     "copy_bytes": settings.copy_bytes},
        "limits": {"copy": copy, "copy_gbps_runs": [c["gbps"] for c in copies]},
        "contenders": [{**dataclasses.asdict(c), **results[c.name]} for c in settings.contenders],
        "targets": model_targets(results, settings.batches),
        "seconds": time.monotonic() - started,
    }


def _num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.{digits}f}"


def _allocator_text(machine: dict[str, Any]) -> str:
    """The C allocator the contenders ran with (the peak memory depends on it), as the record holds it."""
    found = machine.get("allocator") or {}
    env = " ".join(f"{key}={value}" for key, value in (found.get("env") or {}).items())
    return f"{found.get('name', 'unknown')}{f' ({env})' if env else ''}"


def format_model_table(report: dict[str, Any]) -> str:
    """The human table: one row per contender, the decode limits, then the target ratios."""
    model, s = report["model"], report["settings"]
    copy = report["limits"]["copy"]
    lines = [f"hal bench --model {model['name']}: {model['parameters'] / 1e9:.2f} B parameters, "
             f"{model['layers']} layers, hidden {model['hidden']}, heads {model['heads']}/{model['kv_heads']} of "
             f"{model['head_size']}; {report['date']}",
             f"prompt {s['prompt_len']} tokens, {s['new_tokens']} new tokens, batches "
             f"{', '.join(map(str, s['batches']))}; {s['threads']} torch threads; {s['repeat']} round(s)",
             f"copy bandwidth {copy['gbps']:.1f} GB/s ({copy['method']}; the better of before and after); "
             f"C allocator {_allocator_text(report['machine'])}", ""]
    batches = [str(b) for b in s["batches"]]
    head = f"{'contender':<11} {'prefill tok/s':>13} {'TTFT s':>7} " + " ".join(
        f"{'decode b' + b + ' tok/s':>17} {'xlimit':>6}" for b in batches) + f" {'peak MB':>8} {'anon MB':>8}"
    lines += [head, "-" * len(head)]
    for c in report["contenders"]:
        if "error" in c:
            lines.append(f"{c['name']:<11} error: {c['error']}")
            continue
        cells = [f"{c['name']:<11} {_num(c['prefill']['tokens_per_s'], 1):>13} {_num(c['ttft_s'], 3):>7}"]
        for b in batches:
            d = c["decode"][b]
            cells.append(f"{_num(d['tokens_per_s']):>17} {_num(d['ratio_limit']):>6}")
        mem = c["memory"]
        cells.append(f"{mem['peak_rss_bytes'] / 2**20:>8.0f} {mem['peak_anon_bytes'] / 2**20:>8.0f}")
        lines.append(" ".join(cells))
    lines.append("")
    lines.append("decode limit (tokens/s if a step only read its weights and KV at the copy bandwidth):")
    for c in report["contenders"]:
        if "error" not in c:
            limits = ", ".join(f"batch {b} {_num(c['decode'][b]['limit_tokens_per_s'])} "
                               f"({c['decode'][b]['bytes'] / s['new_tokens'] / 1e6:.0f} MB a step)" for b in batches)
            lines.append(f"  {c['name']:<11} {limits}")
    compiled = [c for c in report["contenders"] if "compile_s" in c]
    if compiled:
        lines += ["", "compiled (an untimed round of the timed shapes first; its time, compilation included):"]
        lines += [f"  {c['name']:<11} {c['compile']}: {c['compile_s']:.1f} s, {c['compiled_graphs']} graph(s); "
                  f"{c['compiled_graphs_timed']} compiled in the timed rounds" for c in compiled]
    lines.append("")
    lines.append("targets (ratios of this run):")
    for t in report["targets"]:
        verdict = "not run" if t["met"] is None else ("met" if t["met"] else "short")
        lines.append(f"  {t['ratio']:<70} {_num(t['value']):>6}  target >= {t['target']:.2f}: {verdict}")
    lines.append("")
    lines.append(f"{len(report['contenders'])} contender(s) in {report['seconds']:.0f} s; peak MB: the child's "
                 f"high-water RSS (VmHWM); anon MB: its largest anonymous RSS, sampled (docs/benchmarks.md)")
    return "\n".join(lines)
