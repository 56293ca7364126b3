"""How hal-cpu's kernels behave when the machine is shared: 1 thread against every core, idle and under load.

Usage: ``python plugins/hal_cpu/benchmarks/shared_machine.py [--repeat N] [--loads 0,1,2] [--json PATH]``

For each competing load (that many processes spinning on the CPU, started by
this script and stopped after each measurement) it times a decode step's ops
through the backend's front door, with ``hal_cpu.set_threads(1)`` and with
every core: a W4A16 GEMV (M=1, 4096x4096, 8 MiB packed), a W4A16 GEMM at M=8
(11008x4096), decode attention (8 sequences x 1024 tokens, GQA 32/8, head
128, fp32) and a one-token ``write_kv_cache``. It reports the median and the
90th percentile per call, and the ratio every-core / one-thread: below 1 the
extra threads still pay, above 1 they cost. A pool that collapses under load
shows ratios of several times; hal's should stay near or below 1. After each
load it prints the pool's counters (``hal_cpu.pool_stats()``): jobs in which a
worker lost its core, and jobs the pool then ran on the caller alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import hal_cpu
import numpy as np
from hal_cpu import _threads

import hal_core
from hal_core.quant import quantize


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _cases(be: Any, rng: np.random.Generator) -> dict[str, Callable[[], Any]]:
    ops = be.ops
    w_small = quantize(rng.standard_normal((4096, 4096)).astype(np.float32), bits=4, group_size=128)
    w_mid = quantize(rng.standard_normal((11008, 4096)).astype(np.float32), bits=4, group_size=128)
    x1 = rng.standard_normal((1, 4096)).astype(np.float32)
    x8 = rng.standard_normal((8, 11008)).astype(np.float32)
    seqs, ctx, heads, kv_heads, head, block = 8, 1024, 32, 8, 128, 16
    blocks = seqs * ctx // block
    kc = rng.standard_normal((blocks, kv_heads, block, head)).astype(np.float32)
    vc = rng.standard_normal((blocks, kv_heads, block, head)).astype(np.float32)
    tables = rng.permutation(blocks).astype(np.int32).reshape(seqs, ctx // block)
    lens = np.full(seqs, ctx, dtype=np.int32)
    q = rng.standard_normal((seqs, heads, head)).astype(np.float32)
    k1 = rng.standard_normal((1, kv_heads, head)).astype(np.float32)
    slot = np.array([5], dtype=np.int64)
    return {
        "w4a16 M=1 4096x4096": lambda: ops.quantized_gemm(x1, w_small),
        "w4a16 M=8 11008x4096": lambda: ops.quantized_gemm(x8, w_mid),
        "decode attention 8x1024": lambda: ops.paged_attention(q, kc, vc, tables, lens, scale=head ** -0.5),
        "write_kv_cache 1 token": lambda: ops.write_kv_cache(k1, k1, kc, vc, slot),
    }


def _times(fn: Callable[[], Any], repeat: int) -> list[float]:
    fn()
    out = []
    deadline = time.perf_counter() + 20.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline and len(out) >= 5:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--loads", default="0,1,2", help="comma-separated counts of competing spinning processes")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    seed = int(np.random.SeedSequence().entropy % (2**32))  # type: ignore[operator]
    print(f"seed {seed}", file=sys.stderr)
    be = hal_core.get_backend("cpu")
    cases = _cases(be, np.random.default_rng(seed))
    cores = _threads.available()
    rows: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")
    for load in (int(v) for v in args.loads.split(",")):
        stop = ctx.Event()
        spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        time.sleep(0.5 if load else 0.0)
        try:
            for name, fn in cases.items():
                row: dict[str, Any] = {"case": name, "load": load}
                for label, count in (("one", 1), ("all", cores)):
                    hal_cpu.set_threads(count)
                    t = _times(fn, args.repeat)
                    row[f"{label}_median_us"] = 1e6 * statistics.median(t)
                    row[f"{label}_p90_us"] = 1e6 * float(np.percentile(t, 90))
                row["all_over_one"] = row["all_median_us"] / row["one_median_us"]
                rows.append(row)
                print(f"load {load}  {name:26s} 1 thread {row['one_median_us']:9.1f} us (p90 "
                      f"{row['one_p90_us']:9.1f})  {cores} threads {row['all_median_us']:9.1f} us (p90 "
                      f"{row['all_p90_us']:9.1f})  ratio {row['all_over_one']:.2f}", flush=True)
            stats = hal_cpu.pool_stats()
            print(f"load {load}  pool so far: {stats['starved_jobs']} jobs with a starved worker, "
                  f"{stats['serial_jobs']} run on the caller alone after them", flush=True)
            rows.append({"load": load, "pool": stats})
        finally:
            stop.set()
            for p in spinners:
                p.join(5)
    hal_cpu.set_threads(None)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cores": cores, "seed": seed, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
