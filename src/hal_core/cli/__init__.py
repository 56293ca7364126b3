"""The ``hal`` command: ``hal info`` shows what was found and why; ``hal demo`` runs a checked decode loop.

``hal bench`` times every op against the machine's limits and peers;
``hal tune`` picks kernels and knob values by measurement on this device.

``hal info --json`` prints one JSON document whose keys are documented in
docs/environment.md. ``python -m hal_core`` is the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import hal_core

from ._bench import add_bench_parser
from ._demo import _DTYPES, _cmd_demo, run_demo
from ._info import _cmd_info, collect_info
from ._tune import add_tune_parser

__all__ = ["collect_info", "main", "run_demo"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hal``."""
    parser = argparse.ArgumentParser(prog="hal", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"hal-core {hal_core.__version__} (HAL API {'.'.join(map(str, hal_core.API_VERSION))})")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log hal's decisions (-vv: debug)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="plugins, backends, the selected backend and device capabilities")
    info.add_argument("--json", action="store_true", help="print one JSON document (keys in docs/environment.md)")
    info.add_argument("--stats", action="store_true",
                      help="what the ops front doors did in this process (calls, implementations, fallbacks)")
    info.add_argument("--explain", action="store_true",
                      help="for each op on representative shapes: which implementation would run, and why not others")
    info.add_argument("--shape", action="append", default=[], metavar="OP:KEY=VALUE,...",
                      help="explain this case instead (repeatable), e.g. quantized_gemm:m=1,k=4096,n=4096,bits=4")
    info.add_argument("--backend", help="backend to explain (default: the selected one)")
    info.set_defaults(func=_cmd_info)

    demo = commands.add_parser("demo", help="decode steps over a paged KV cache, checked against the reference")
    demo.add_argument("--backend", help="backend name (default: HAL_BACKEND, else the best available)")
    demo.add_argument("--seqs", type=int, default=8, help="sequences in the batch (default 8)")
    demo.add_argument("--max-len", type=int, default=512, help="longest prompt, tokens (default 512)")
    demo.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    demo.add_argument("--kv-heads", type=int, default=4, help="key/value heads, dividing --heads (default 4)")
    demo.add_argument("--head-size", type=int, default=128, help="default 128")
    demo.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16)")
    demo.add_argument("--dtype", choices=_DTYPES, default="fp16", help="default fp16")
    demo.add_argument("--steps", type=int, default=4, help="decode steps (default 4)")
    demo.add_argument("--hidden", type=int, default=2048, help="model width (default 2048)")
    demo.add_argument("--group-size", type=int, default=128, help="int4 quantisation group (default 128)")
    demo.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    demo.set_defaults(func=_cmd_demo)
    add_bench_parser(commands)
    add_tune_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hal`` with ``argv`` (default: the command line); return the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. `hal info --json | head`: stop quietly, like other commands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
