"""``hal bench``: every op over preset or given shapes, against the machine's limits and peers, in one run;
``--model``: a whole model's tokens/s and memory, per contender."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ._bench_model import add_model_options, run_model_command
from ._cases_args import add_case_options, add_timing_options, cases_from, policy_from

__all__ = ["add_bench_parser"]

_REPEAT, _MAX_TIME = 10, 1.0


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="time every op against the measured copy bandwidth, BLAS rate and peers",
                                description=__doc__.replace("``", ""))
    add_case_options(bench, "all")
    add_timing_options(bench, _REPEAT, _MAX_TIME)
    bench.add_argument("--peers", default=None, metavar="NAMES",
                       help="comma-separated peer names (substrings) to run, or 'none' (default: every one "
                            "that applies and is installed)")
    bench.add_argument("--cached-weights", action="store_true",
                       help="reuse one input set for every call (default: rotate distinct sets, docs/benchmarks.md)")
    bench.add_argument("--budget", type=float, default=None, metavar="S",
                       help="skip the cases not started within S seconds")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    bench.add_argument("--rounds", type=int, default=1, metavar="N",
                       help="measure every case N times, round-robin over the cases, and pool the samples "
                            "(robust to bursts of load on a shared machine; default 1)")
    bench.add_argument("--no-overhead", action="store_true",
                       help="skip the rows of what a call costs above its kernel (front door, torch.ops.hal) "
                            "and beside torch's ops (interference)")
    bench.add_argument("--json", metavar="PATH", help="write the full report as JSON (schema in docs/benchmarks.md)")
    bench.add_argument("--plot", metavar="PATH", help="draw ratio against size (needs: pip install 'hal-core[bench]')")
    add_model_options(bench)
    bench.set_defaults(func=_cmd_bench)


def _fail(message: str) -> int:
    print(f"hal bench: error: {message}", file=sys.stderr)
    return 2


def _cmd_bench(args: argparse.Namespace) -> int:
    import hal_core
    from hal_core import HalError, bench

    if args.model is not None:
        return run_model_command(args)
    try:
        policy = policy_from(args, _REPEAT, _MAX_TIME)
        cases = cases_from(args, "all")
    except bench.BenchArgumentError as exc:
        return _fail(str(exc))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return _fail("argument --plot needs matplotlib, which is not installed: pip install 'hal-core[bench]'")
    if args.budget is not None and args.budget <= 0:
        return _fail(f"argument --budget: expected > 0 seconds, got {args.budget}")
    if args.rounds < 1:
        return _fail(f"argument --rounds: expected >= 1, got {args.rounds}")
    peers = None
    if args.peers is not None:
        names = [p.strip() for p in args.peers.split(",") if p.strip()]
        peers = () if names in ([], ["none"]) else tuple(names)
    try:
        backend = hal_core.get_backend(args.backend)
    except HalError as exc:
        return _fail(f"argument --backend: {exc}")
    settings = bench.BenchSettings(policy=policy, quick=args.quick, cached_weights=args.cached_weights,
                                   peers=peers, budget_s=args.budget, seed=args.seed, rounds=args.rounds,
                                   overhead=not args.no_overhead and not args.quick)
    host = bench.array_module(backend).__name__ == "numpy"
    progress = bench.Progress(bench.planned_steps(cases, host, peers, args.rounds), enabled=not args.quiet)
    argv = ["hal", *getattr(args, "argv", sys.argv[1:])]
    report = bench.run_bench(cases, backend, settings, progress=progress, argv=argv)
    print(bench.format_table(report))
    if args.json:
        print(f"\nwrote {bench.write_report(report, args.json)}")
    if args.plot:
        print(f"wrote {bench.plot_report(report, args.plot)}")
    return 0
