"""Command-line options shared by ``hal bench`` and ``hal tune``: which cases, how to time them."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["WARMUP_SECONDS", "add_case_options", "add_timing_options", "cases_from", "policy_from"]

#: Untimed calls continue this long before timing starts (a call after a pause runs slower for the first few
#: milliseconds of calls while the worker threads and the machine wake up; engines call ops continuously).
WARMUP_SECONDS = 0.25


def add_case_options(parser: argparse.ArgumentParser, default_preset: str) -> None:
    from ..bench import bench_params, preset_names

    parser.add_argument("--backend", help="backend name (default: HAL_BACKEND, else the best available)")
    parser.add_argument("--preset", choices=preset_names(), default=None,
                        help=f"a shape grid (default {default_preset} when no --shape is given)")
    parser.add_argument("--op", action="append", choices=list(bench_params()), default=None,
                        help="only this op (repeatable); with --shape, the op the shapes are for")
    parser.add_argument("--shape", action="append", default=None, metavar="KEY=VALUE,...",
                        help="one case, e.g. M=1,K=4096,N=11008,bits=4,group=128 with --op quantized_gemm "
                             "(or prefixed: quantized_gemm:M=1,...); repeatable; keys in docs/benchmarks.md")


def add_timing_options(parser: argparse.ArgumentParser, repeat: int, max_time: float) -> None:
    parser.add_argument("--repeat", type=int, default=None,
                        help=f"timed runs per measurement, at most (default {repeat})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1)")
    parser.add_argument("--warmup-time", type=float, default=None, metavar="S",
                        help=f"and untimed runs until S seconds of them have passed (default {WARMUP_SECONDS:g}; "
                             "--quick: 0)")
    parser.add_argument("--max-time", type=float, default=None, metavar="S",
                        help=f"stop a measurement after S seconds once 3 runs exist (default {max_time:g})")
    parser.add_argument("--quick", action="store_true", help="few short runs (tests, CI): --repeat 3 --max-time 0.2")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")


def policy_from(args: argparse.Namespace, repeat: int, max_time: float) -> Any:
    from ..bench import BenchArgumentError, TimingPolicy

    quick = args.quick
    try:
        return TimingPolicy(
            repeat=args.repeat if args.repeat is not None else (3 if quick else repeat),
            warmup=args.warmup if args.warmup is not None else 1,
            min_repeat=min(3, args.repeat) if args.repeat is not None else 3,
            max_seconds=args.max_time if args.max_time is not None else (0.2 if quick else max_time),
            warmup_seconds=args.warmup_time if args.warmup_time is not None else (0.0 if quick else WARMUP_SECONDS),
        )
    except ValueError as exc:
        raise BenchArgumentError(str(exc)) from None


def cases_from(args: argparse.Namespace, default_preset: str) -> list[Any]:
    """The cases the options name: ``--shape`` ones, then the preset's (filtered by ``--op``)."""
    from ..bench import BenchArgumentError, parse_shape, preset_cases

    cases = []
    ops = args.op or []
    for text in args.shape or ():
        head, colon, rest = text.partition(":")
        if colon and "=" not in head:
            cases.append(parse_shape(head.strip(), rest))
            continue
        if len(ops) != 1:
            raise BenchArgumentError(
                f"argument --shape: {text!r} needs exactly one --op (got {len(ops)}), or an op prefix "
                f"such as quantized_gemm:{text}")
        cases.append(parse_shape(ops[0], text))
    if args.preset or not cases:
        cases += preset_cases(args.preset or default_preset, ops or None)
    seen: dict[Any, None] = {}
    for case in cases:
        seen.setdefault(case, None)
    return list(seen)
