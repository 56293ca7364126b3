"""The small-batch ``quantized_gemm`` sweep: W4A16 and W8A8 at M = 1..64 against the machine's limits, in one run.

Usage: ``python plugins/hal_cpu/benchmarks/gemm_sweep.py [--repeat N] [--ms 1,2,4] [--dtype fp16] [--json PATH]``
or ``OPENBLAS_NUM_THREADS=1 python plugins/hal_cpu/benchmarks/gemm_sweep.py --one-thread ...``

For each shape (4096x11008 and 11008x4096, K x N), format and M it times
``quantized_gemm.gemm`` (median of ``--repeat`` calls after a warm-up) and,
in the same process, two limits:

- the copy bandwidth (a 256 MiB ``np.copyto`` over every core, read + write
  bytes): ``of_copy`` is the weight's bytes (codes + scales) per second over
  it;
- the fp32 BLAS time of the same float shapes (numpy ``matmul`` of ``[M, K]``
  by a float32 ``[K, N]``): ``of_blas`` is that time over hal's time (the same
  FLOPs).

A cell is bandwidth-bound while the weight's bytes over the copy bandwidth
take longer than its FLOPs at the BLAS peak rate (numpy at M = 256 on the
same shape), compute-bound from there; ``bound`` names which, and
``target`` is the matching ratio (``of_copy`` or ``of_blas``). Kernels and
the limits are measured in rounds, interleaved, and each figure is the
median over rounds: on a shared machine compare ratios, not times.

``--one-thread`` measures the calling thread's CPU time of one-thread calls
(hal's kernels with ``threads=1``, numpy's BLAS limited to one thread by
``OPENBLAS_NUM_THREADS=1``): on a machine shared with other jobs, time spent
descheduled does not count, so the compute-bound ratios (``of_blas``) stay
meaningful; the copy bandwidth is then one thread's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.ops.quantized_gemm import random_weight

SHAPES = [(4096, 11008), (11008, 4096)]
DTYPES = {"fp16": np.float16, "bf16": BFLOAT16, "fp32": np.float32}


_clock = time.perf_counter


def _median_time(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return statistics.median(times)


def _copier(threads: int) -> Callable[[], None]:
    src = np.ones(64 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)

    def copy() -> None:
        workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b]))
                   for a, b in itertools.pairwise(bounds[1:])]
        for w in workers:
            w.start()
        np.copyto(dst[: bounds[1]], src[: bounds[1]])
        for w in workers:
            w.join()

    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="calls per kernel per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over rounds)")
    parser.add_argument("--ms", default="1,2,4,8,16,32,64")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--shapes", default="4096x11008,11008x4096")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the machine's load)")
    parser.add_argument("--one-thread", action="store_true",
                        help="one thread, the thread's CPU time (needs OPENBLAS_NUM_THREADS=1)")
    args = parser.parse_args(argv)
    global _clock
    native = _native.load()
    threads = native.threads
    if args.one_thread:
        if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
            parser.error("--one-thread needs OPENBLAS_NUM_THREADS=1 in the environment (numpy's BLAS on one thread)")
        _clock, threads = time.thread_time, 1
    ms = [int(v) for v in args.ms.split(",")]
    bits_list = [int(v) for v in args.bits.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    copy = _copier(threads)
    copy_bytes = 2 * (64 << 20) * 4
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    samples: dict[tuple[Any, ...], list[float]] = {}
    copy_bw: list[float] = []
    for k, n in shapes:
        weights = {bits: random_weight(rng, k, n, bits, 128) for bits in bits_list}
        w32 = rng.standard_normal((k, n), dtype=np.float32)
        xs = {m: rng.uniform(-1, 1, (m, k)).astype(np.float32) for m in [*ms, 256]}
        for _ in range(args.rounds):
            copy_bw.append(copy_bytes / _median_time(copy, args.repeat))
            for m in [*ms, 256]:
                x32 = xs[m]
                key = ("blas", k, n, m)
                samples.setdefault(key, []).append(
                    _median_time(lambda x32=x32, w32=w32: x32 @ w32, max(2, args.repeat // 2)))
                if m == 256:
                    continue
                x = x32.astype(DTYPES[args.dtype])
                for bits, qw in weights.items():
                    key = ("hal", k, n, m, bits)
                    samples.setdefault(key, []).append(
                        _median_time(lambda x=x, qw=qw: quantized_gemm.gemm(x, qw, threads=threads), args.repeat))
        for bits, qw in weights.items():
            for m in ms:
                rows[(k, n, m, bits)] = {"k": k, "n": n, "m": m, "bits": bits, "weight_bytes": qw.nbytes}
    bw = statistics.median(copy_bw)
    out = []
    for (k, n, m, bits), row in rows.items():
        t = statistics.median(samples[("hal", k, n, m, bits)])
        t_blas = statistics.median(samples[("blas", k, n, m)])
        peak = 2 * 256 * k * n / statistics.median(samples[("blas", k, n, 256)])
        flops = 2 * m * k * n
        bound = "compute" if flops / peak > row["weight_bytes"] / bw else "bandwidth"
        of_copy = row["weight_bytes"] / t / bw
        of_blas = t_blas / t
        row.update(ms=t * 1e3, blas_ms=t_blas * 1e3, of_copy=of_copy, of_blas=of_blas, bound=bound,
                   target=of_copy if bound == "bandwidth" else of_blas, gflops=flops / t / 1e9,
                   blas_peak_gflops=peak / 1e9)
        out.append(row)
    print(f"isa={native.isa} threads={threads} clock={_clock.__name__} copy={bw / 1e9:.1f} GB/s dtype={args.dtype} "
          f"(medians of {args.rounds} rounds x {args.repeat} calls)")
    print(f"{'format':6} {'KxN':>10} {'M':>3} {'ms':>8} {'blas ms':>8} {'xcopy':>6} {'xBLAS':>6} {'bound':>9} "
          f"{'target':>6}")
    for r in sorted(out, key=lambda r: (r["bits"], r["k"], r["m"])):
        print(f"{'W4A16' if r['bits'] == 4 else 'W8A8':6} {r['k']:>5}x{r['n']:<5} {r['m']:>3} {r['ms']:8.2f} "
              f"{r['blas_ms']:8.2f} {r['of_copy']:6.2f} {r['of_blas']:6.2f} {r['bound']:>9} {r['target']:6.2f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        with open(args.json, "w") as f:
            machine = platform.processor() or platform.machine()
            json.dump({"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": machine, "isa": native.isa,
                       "threads": threads, "clock": _clock.__name__, "copy_gbps": bw / 1e9,
                       "dtype": args.dtype, "rounds": args.rounds, "repeat": args.repeat, "note": args.note,
                       "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
