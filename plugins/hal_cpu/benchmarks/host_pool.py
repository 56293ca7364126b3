"""hal-cpu beside torch: an op alone against the same op alternating with a small torch op, per pool.

Usage: ``python plugins/hal_cpu/benchmarks/host_pool.py [--repeat N] [--rounds R] [--json PATH]``

torch's CPU ops run on its OpenMP runtime, whose threads keep polling for the
next region after each op (libgomp's default active wait). hal-cpu's own pool
then fights them for the cores; on the host pool (csrc/dispatch.cpp, Parallel
jobs) hal's tasks run on those same threads. Each configuration runs in a
fresh process (its environment differs), times a W4A16 GEMV (M=1,
4096x11008, through ``be.ops``) alone and with a small ``torch.mm`` before
each call (the hal call alone is timed), over interleaved rounds, and prints
the medians, their ratio (alternating / alone: 1 means no interference) and
the pool's counters:

- ``own``: ``HAL_CPU_HOST_POOL=0``, hal's own workers beside torch's;
- ``host``: the default, hal's jobs on torch's OpenMP team;
- ``own+passive``: ``HAL_CPU_HOST_POOL=0`` with ``OMP_WAIT_POLICY=PASSIVE``
  set by hand (torch's threads block after each region; the reference).

Wall-clock figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = {
    "own": {"HAL_CPU_HOST_POOL": "0"},
    "host": {},
    "own+passive": {"HAL_CPU_HOST_POOL": "0", "OMP_WAIT_POLICY": "PASSIVE"},
}


def measure(repeat: int, rounds: int) -> dict[str, Any]:
    """In this process: median ms of the op alone and alternating with torch.mm, over interleaved rounds."""
    import hal_cpu
    import numpy as np
    import torch

    import hal_core
    from hal_core.quant import quantize

    be = hal_core.get_backend("cpu")
    rng = np.random.default_rng(0)
    weight = quantize(rng.standard_normal((4096, 11008)).astype(np.float32), bits=4, group_size=128)
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    a, b = torch.randn(64, 256), torch.randn(256, 256)

    def op() -> float:
        start = time.perf_counter()
        be.ops.quantized_gemm(x, weight)
        return (time.perf_counter() - start) * 1e3

    def alternating() -> float:
        torch.mm(a, b)
        return op()

    for _ in range(10):
        alternating()
    alone: list[float] = []
    mixed: list[float] = []
    for _ in range(rounds):
        alone += [op() for _ in range(repeat)]
        mixed += [alternating() for _ in range(repeat)]
    return {"alone_ms": statistics.median(alone), "alternating_ms": statistics.median(mixed),
            "ratio": statistics.median(mixed) / statistics.median(alone), "pool_stats": hal_cpu.pool_stats(),
            "host_runtime": hal_cpu.host_runtime(), "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30, help="calls per round and kind (default 30)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.repeat, args.rounds)))
        return 0
    results = {}
    for name, extra in CONFIGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("HAL_CPU_HOST_POOL", "OMP_WAIT_POLICY")}
        child = subprocess.run([sys.executable, __file__, "--child", "--repeat", str(args.repeat),
                                "--rounds", str(args.rounds)], capture_output=True, text=True,
                               env={**env, **extra}, check=True)
        results[name] = json.loads(child.stdout.splitlines()[-1])
        r = results[name]
        stats = r["pool_stats"]
        print(f"{name:<12} alone {r['alone_ms']:7.3f} ms  with torch.mm {r['alternating_ms']:7.3f} ms  "
              f"x{r['ratio']:.2f}  (own {stats['own_pool_jobs']}, host {stats['host_pool_jobs']}, "
              f"starved {stats['starved_jobs']}, serial {stats['serial_jobs']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
