"""``hal bench --model``: the options of the whole-model benchmark and the command that runs it."""

from __future__ import annotations

import argparse
import importlib.util
import sys

__all__ = ["add_model_options", "run_model_command"]

_MISSING = "pip install 'hal-core[torch]' transformers safetensors"


def add_model_options(bench: argparse.ArgumentParser) -> None:
    from ..bench._model_spec import BUILTIN_MODELS, CONTENDERS

    group = bench.add_argument_group(
        "whole model (--model)", "tokens/s, time to first token and peak memory of a random-weight Llama-"
        "architecture model, per contender, each in its own process (docs/benchmarks.md)")
    group.add_argument("--model", metavar="NAME|PATH",
                       help=f"a built-in size ({', '.join(BUILTIN_MODELS)}) or a Hugging Face config.json (or "
                            f"its directory); its weights are random")
    group.add_argument("--contenders", metavar="NAMES", default=None,
                       help=f"comma-separated, from {', '.join(CONTENDERS)} (default: all)")
    group.add_argument("--prompt-len", type=int, default=512, metavar="N", help="prompt tokens (default 512)")
    group.add_argument("--new-tokens", type=int, default=64, metavar="N", help="decode steps (default 64)")
    group.add_argument("--batches", default="1,8", metavar="B,...",
                       help="decode batch sizes (default 1,8; prefill runs at batch 1)")
    group.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch intra-op threads in every contender (default: every core)")
    group.add_argument("--group-size", type=int, default=128, metavar="G",
                       help="group of the int4/int8 checkpoints (default 128)")


def _fail(message: str) -> int:
    print(f"hal bench: error: {message}", file=sys.stderr)
    return 2


def run_model_command(args: argparse.Namespace) -> int:
    """``hal bench --model``: parse the options, run every contender, print the table (and write the JSON)."""
    from hal_core import bench
    from hal_core.bench._model import ModelBenchSettings, format_model_table, model_steps, run_model_bench
    from hal_core.bench._model_spec import resolve_contenders, resolve_model

    if args.op or args.shape or args.preset:
        return _fail("argument --model: runs a whole model; --op, --shape and --preset choose op cases instead")
    if args.plot:
        return _fail("argument --plot: not drawn for --model (the table and --json hold its figures)")
    missing = [name for name in ("torch", "transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        return _fail(f"argument --model needs {', '.join(missing)}, not installed: {_MISSING}")
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError:
        return _fail(f"argument --batches: expected comma-separated integers, got {args.batches!r}")
    try:
        extra: dict[str, int] = {} if args.threads is None else {"threads": args.threads}
        if args.quick:
            extra["copy_bytes"] = 32 << 20
        settings = ModelBenchSettings(
            model=resolve_model(args.model), contenders=resolve_contenders(args.contenders),
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, batches=batches,
            repeat=args.repeat if args.repeat is not None else 1, seed=args.seed, group_size=args.group_size,
            **extra)
    except bench.BenchArgumentError as exc:
        return _fail(str(exc))
    progress = bench.Progress(model_steps(settings), enabled=not args.quiet)
    argv = ["hal", *getattr(args, "argv", sys.argv[1:])]
    report = run_model_bench(settings, progress=progress, argv=argv)
    print(format_model_table(report))
    if args.json:
        print(f"\nwrote {bench.write_report(report, args.json)}")
    failed = [c["name"] for c in report["contenders"] if "error" in c]
    return 1 if failed else 0
