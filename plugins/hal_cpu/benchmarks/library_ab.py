"""Two builds of hal-cpu's library on the same W4A16 launches, interleaved in one process.

Usage: ``python plugins/hal_cpu/benchmarks/library_ab.py BEFORE.so [--dtype bf16] [--rounds 12] [--json PATH]``

``BEFORE.so`` is ``hal_cpu/_kernels.so`` built from another commit (copy it aside before rebuilding). Both
libraries run the same variant (the one this CPU's best) on the same argument structs: the launch the
installed build's Python prepares (:func:`hal_cpu.ops.quantized_gemm._launch`, the in-register kernel) for
six weights per shape, rotated so that they come from memory, not the caches. Rounds alternate which build
goes first. Each figure is the best and the median over rounds of the mean time per call; ``GB/s`` counts the
packed weight's bytes, beside the machine's copy bandwidth measured in the same run. Run it on a quiet
machine: the kernels of both builds share it, so a burst of load slows both, but only within a round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import quantized_gemm
from measure import copy_bandwidth  # the sibling script's helpers

from hal_core.testing.inputs import quantized_gemm_inputs

#: (M, K, N): decode GEMVs of 1B-8B models and one two-row case.
SHAPES = [(1, 4096, 4096), (1, 4096, 11008), (1, 11008, 4096), (1, 2048, 2048), (1, 2048, 5632), (2, 4096, 4096)]
WEIGHTS = 6


def _before(path: str, native: _native.Native) -> Any:
    lib = ctypes.CDLL(path)
    lib.hal_cpu_select_isa.restype, lib.hal_cpu_select_isa.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    chosen = lib.hal_cpu_select_isa(native.isa.encode())
    if chosen is None or chosen.decode() != native.isa:
        raise SystemExit(f"{path} cannot run the {native.isa} variant")
    fn = lib.hal_cpu_w4a16_gemv
    fn.argtypes, fn.restype = native.lib.hal_cpu_w4a16_gemv.argtypes, native.lib.hal_cpu_w4a16_gemv.restype
    return fn


def compare(before: str, dtype: str, rounds: int) -> list[dict[str, Any]]:
    """One row per shape: best and median seconds per call of each build, and before / after."""
    native = _native.load()
    fns = {"before": _before(before, native), "after": native.lib.hal_cpu_w4a16_gemv}
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in SHAPES:
        cases = [quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=4, group_size=128, symmetric=True, dtype=dtype)
                 for _ in range(WEIGHTS)]
        launches = [quantized_gemm._launch(native, c["x"], c["qweight"], "registers",
                                           quantized_gemm.half_dot(native, c["x"].dtype)) for c in cases]
        outputs = [np.empty((m, n), np.float32) for _ in cases]
        times: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(rounds + 1):
            for side in ("before", "after") if r % 2 else ("after", "before"):
                start = time.perf_counter()
                for launch, case, y in zip(launches, cases, outputs, strict=True):
                    args = type(launch.template).from_buffer_copy(launch.template)
                    args.x, args.y = _native.pointer(case["x"]), _native.pointer(y)
                    fns[side](ctypes.byref(args))
                if r:  # the first round warms both up
                    times[side].append((time.perf_counter() - start) / len(cases))
        nbytes = cases[0]["qweight"].nbytes
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "dtype": dtype, "weight_bytes": nbytes}
        for side, found in times.items():
            row[side] = {"best_ms": min(found) * 1e3, "median_ms": statistics.median(found) * 1e3,
                         "best_gb_s": nbytes / min(found) / 1e9}
        row["speedup_best"] = min(times["before"]) / min(times["after"])
        row["speedup_median"] = statistics.median(times["before"]) / statistics.median(times["after"])
        rows.append(row)
        print(f"M={m} {k}x{n} {dtype}: before {row['before']['best_ms']:.3f} ms ({row['before']['best_gb_s']:.1f} "
              f"GB/s), after {row['after']['best_ms']:.3f} ms ({row['after']['best_gb_s']:.1f} GB/s); "
              f"{row['speedup_best']:.2f}x best, {row['speedup_median']:.2f}x median", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="hal_cpu/_kernels.so built from the commit to compare against")
    parser.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", help="write the rows and the copy bandwidth here")
    args = parser.parse_args(argv)
    native = _native.load()
    copy = copy_bandwidth(native.threads, 5)
    print(f"copy bandwidth {copy / 1e9:.1f} GB/s ({native.threads} threads); variant {native.isa}")
    rows = compare(args.before, args.dtype, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gb_s": copy / 1e9, "isa": native.isa, "threads": native.threads, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
