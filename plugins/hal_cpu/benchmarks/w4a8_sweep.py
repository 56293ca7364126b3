"""W4A16 beside W4A8 (``activations="int8"``) for the same int4 weight, at M = 1..64: where integer dot products pay.

Usage: ``python plugins/hal_cpu/benchmarks/w4a8_sweep.py [--rounds N] [--ms 1,2,4] [--dtype fp16] [--json PATH]``
or ``python plugins/hal_cpu/benchmarks/w4a8_sweep.py --one-thread ...``

For 4096x4096 and 4096x11008 (K x N), G = 128, symmetric fp16 scales, it
times ``quantized_gemm.gemm`` with float activations (W4A16, the kernel the
rules pick) and with ``activations="int8"`` (W4A8, the integer kernel),
interleaved in rounds after a warm-up; each figure is the median over rounds
and ``speedup`` is W4A16's time over W4A8's. ``--one-thread`` runs both with
``threads=1`` and measures the calling thread's CPU time, so time spent
descheduled on a shared machine does not count. Run it on a quiet machine
before choosing a default from it: on a shared one compare ratios only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.ops.quantized_gemm import random_weight

SHAPES = [(4096, 4096), (4096, 11008)]
DTYPES = {"fp16": np.float16, "bf16": BFLOAT16, "fp32": np.float32}


def _time(fn: Callable[[], Any], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def sweep(ms: list[int], dtype: str, rounds: int, one_thread: bool) -> list[dict[str, Any]]:
    """One row per shape and M: the median seconds of W4A16 and W4A8 and their ratio."""
    rng = np.random.default_rng(0)
    clock = time.thread_time if one_thread else time.perf_counter
    threads = 1 if one_thread else None
    rows = []
    for k, n in SHAPES:
        weight = random_weight(rng, k, n, 4, 128)
        for m in ms:
            x = rng.uniform(-1.0, 1.0, size=(m, k)).astype(DTYPES[dtype])
            runs: dict[str, Callable[[], Any]] = {
                "w4a16": lambda x=x, w=weight: quantized_gemm.gemm(x, w, threads=threads),
                "w4a8": lambda x=x, w=weight: quantized_gemm.gemm(x, w, threads=threads, activations="int8"),
            }
            for fn in runs.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(rounds):
                for name, fn in runs.items():
                    times[name].append(_time(fn, clock))
            w4a16, w4a8 = (statistics.median(times[name]) for name in ("w4a16", "w4a8"))
            rows.append({"k": k, "n": n, "m": m, "w4a16_ms": 1e3 * w4a16, "w4a8_ms": 1e3 * w4a8,
                         "speedup": w4a16 / w4a8})
    return rows


def main() -> None:
    """Parse the options, run the sweep, print a table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,2,4,8,16,32,64", help="comma-separated M values")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--one-thread", action="store_true")
    parser.add_argument("--json", help="also write the rows here")
    opts = parser.parse_args()
    native = _native.load()
    rows = sweep([int(v) for v in opts.ms.split(",")], opts.dtype, opts.rounds, opts.one_thread)
    print(f"isa={native.isa} threads={1 if opts.one_thread else native.threads} dtype={opts.dtype}")
    print(f"{'K x N':>12} {'M':>4} {'W4A16 ms':>10} {'W4A8 ms':>10} {'W4A16/W4A8':>11}")
    for row in rows:
        print(f"{row['k']:>5} x {row['n']:<5} {row['m']:>4} {row['w4a16_ms']:>10.3f} {row['w4a8_ms']:>10.3f} "
              f"{row['speedup']:>11.2f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"isa": native.isa, "one_thread": opts.one_thread, "dtype": opts.dtype, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
