"""W8A8 (int8 weights, activations quantised per token) at M = 1..512 beside numpy's float32 BLAS on the same shapes.

Usage: ``python plugins/hal_cpu/benchmarks/w8a8_sweep.py [--rounds N] [--ms 1,8,64] [--dtype bf16] [--json PATH]``

For 4096x4096 and 4096x11008 (K x N), G = 128, symmetric fp16 scales, it
times ``quantized_gemm.gemm`` on the int8 weight, then ``numpy.matmul`` on its
float32 dequantisation (the machine's BLAS rate); each figure is the median
over rounds after a warm-up. ``gflops`` counts 2 M K N
per call; ``vs_blas`` is BLAS time over W8A8 time. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import quantized_gemm
from measure import DTYPES, timed  # the sibling script's helpers

from hal_core.bench._peers import dequantize_float32
from hal_core.ops.quantized_gemm import random_weight

SHAPES = [(4096, 4096), (4096, 11008)]


def sweep(ms: list[int], dtype: str, rounds: int) -> list[dict[str, Any]]:
    """One row per shape and M: the median seconds of W8A8 and of the float32 BLAS, their rates and ratio.

    Every W8A8 case runs before any BLAS call: a BLAS library's threads spin for a while after each call and
    would take cores from hal's pool (what ``hal bench``'s interference row measures, not this sweep)."""
    rng = np.random.default_rng(0)
    cases = []
    for k, n in SHAPES:
        weight = random_weight(rng, k, n, 8, 128)
        for m in ms:
            x = rng.uniform(-1.0, 1.0, size=(m, k)).astype(DTYPES[dtype])
            cases.append((k, n, m, weight, x, timed(lambda x=x, w=weight: quantized_gemm.gemm(x, w), rounds)))
    rows = []
    for k, n, m, weight, x, w8a8 in cases:
        dense = dequantize_float32(weight)
        x32 = x.astype(np.float32)
        out = np.empty((m, n), dtype=np.float32)
        blas = timed(lambda x32=x32, d=dense, out=out: np.matmul(x32, d, out=out), rounds)
        flops = 2.0 * m * k * n
        rows.append({"k": k, "n": n, "m": m, "w8a8_ms": 1e3 * w8a8, "blas_ms": 1e3 * blas,
                     "w8a8_gflops": flops / w8a8 / 1e9, "blas_gflops": flops / blas / 1e9, "vs_blas": blas / w8a8})
    return rows


def main() -> None:
    """Parse the options, run the sweep, print a table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,2,4,8,16,64,256,512", help="comma-separated M values")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rows here")
    opts = parser.parse_args()
    native = _native.load()
    rows = sweep([int(v) for v in opts.ms.split(",")], opts.dtype, opts.rounds)
    print(f"isa={native.isa} threads={native.threads} dtype={opts.dtype}")
    print(f"{'K x N':>12} {'M':>4} {'W8A8 ms':>9} {'GFLOP/s':>8} {'BLAS ms':>9} {'GFLOP/s':>8} {'BLAS/W8A8':>10}")
    for row in rows:
        print(f"{row['k']:>5} x {row['n']:<5} {row['m']:>4} {row['w8a8_ms']:>9.3f} {row['w8a8_gflops']:>8.1f} "
              f"{row['blas_ms']:>9.3f} {row['blas_gflops']:>8.1f} {row['vs_blas']:>10.2f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"isa": native.isa, "threads": native.threads, "dtype": opts.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
