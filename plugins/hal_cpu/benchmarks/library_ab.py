"""Two builds of hal-cpu's library on the same W4A16 (W4A8, W8A8) launches, interleaved in one process.

Usage: ``python plugins/hal_cpu/benchmarks/library_ab.py BEFORE.so [--kernel w4a16|w4a8|w8a8] [--dtype bf16]
[--rounds 12] [--rows M] [--json PATH]`` (``--rows``: every shape at that M)

``BEFORE.so`` is ``hal_cpu/_kernels.so`` built from another commit (copy it aside before rebuilding). Both
libraries run the same variant (the one this CPU's best) on the same argument structs: the launch the
installed build's Python prepares (:func:`hal_cpu.ops.quantized_gemm._launch`, the in-register kernel, or
with ``--kernel w4a8`` :func:`hal_cpu.ops._w4a8._launch`, the integer kernel, then also timed against the
installed build's W4A16 on the same weights as a third side, ``w4a16``; with ``--kernel w8a8`` int8 weights and
the W8A8 kernel, on the decode shapes and the lm_heads of 1B-class models) for six weights per shape, rotated so
that they come from memory, not the caches. Rounds alternate which build
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
from hal_cpu.ops import _w4a8, quantized_gemm
from measure import copy_bandwidth  # the sibling script's helpers

from hal_core.testing.inputs import quantized_gemm_inputs

#: (M, K, N): decode GEMVs of 1B-8B models and one two-row case.
SHAPES = [(1, 4096, 4096), (1, 4096, 11008), (1, 11008, 4096), (1, 2048, 2048), (1, 2048, 5632), (2, 4096, 4096)]
#: W8A8 also on int8 lm_heads (hidden x vocabulary): the benchmark models' 1024 x 32000 and 2048 x 32000.
LM_HEADS = [(1, 1024, 32000), (1, 2048, 32000)]
#: ``--kernel`` -> the library entry point it times.
SYMBOLS = {"w4a16": "hal_cpu_w4a16_gemv", "w4a8": "hal_cpu_w4a8_gemm", "w8a8": "hal_cpu_w8a8_gemm"}
WEIGHTS = 6


def _before(path: str, native: _native.Native, symbol: str) -> Any:
    lib = ctypes.CDLL(path)
    lib.hal_cpu_select_isa.restype, lib.hal_cpu_select_isa.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    chosen = lib.hal_cpu_select_isa(native.isa.encode())
    if chosen is None or chosen.decode() != native.isa:
        raise SystemExit(f"{path} cannot run the {native.isa} variant")
    fn, mine = getattr(lib, symbol), getattr(native.lib, symbol)
    fn.argtypes, fn.restype = mine.argtypes, mine.restype
    return fn


def compare(before: str, dtype: str, rounds: int, kernel: str = "w4a16",
            rows_m: int | None = None) -> list[dict[str, Any]]:
    """One row per shape: best and median seconds per call of each build (and, for W4A8, of W4A16), and
    before / after."""
    native = _native.load()
    symbol = SYMBOLS[kernel]
    fns = {"before": _before(before, native, symbol), "after": getattr(native.lib, symbol)}
    rng = np.random.default_rng(0)
    rows = []
    shapes = SHAPES + (LM_HEADS if kernel == "w8a8" else [])
    if rows_m is not None:
        shapes = sorted({(rows_m, k, n) for _, k, n in shapes})
    for m, k, n in shapes:
        cases = [quantized_gemm_inputs(rng, m=m, k=k, n=n, bits=8 if kernel == "w8a8" else 4, group_size=128,
                                       symmetric=True, dtype=dtype) for _ in range(WEIGHTS)]
        # The in-register W4A16 launch (int4 weights), the W8A8 one (int8 weights).
        plain = [quantized_gemm._launch(native, c["x"], c["qweight"], "registers",
                                        quantized_gemm.half_dot(native, c["x"].dtype)) for c in cases]
        launches = {"before": plain, "after": plain}
        if kernel == "w4a8":
            w4a8 = [_w4a8._launch(native, c["x"], c["qweight"], None) for c in cases]
            launches = {"before": w4a8, "after": w4a8, "w4a16": plain}
            fns["w4a16"] = native.lib.hal_cpu_w4a16_gemv
        outputs = [np.empty((m, n), np.float32) for _ in cases]
        times: dict[str, list[float]] = {side: [] for side in launches}
        for r in range(rounds + 1):
            for side in list(launches) if r % 2 else list(reversed(launches)):
                start = time.perf_counter()
                for launch, case, y in zip(launches[side], cases, outputs, strict=True):
                    args = type(launch.template).from_buffer_copy(launch.template)
                    args.x, args.y = _native.pointer(case["x"]), _native.pointer(y)
                    fns[side](ctypes.byref(args))
                if r:  # the first round warms every side up
                    times[side].append((time.perf_counter() - start) / len(cases))
        nbytes = cases[0]["qweight"].nbytes
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "dtype": dtype, "weight_bytes": nbytes}
        for side, found in times.items():
            row[side] = {"best_ms": min(found) * 1e3, "median_ms": statistics.median(found) * 1e3,
                         "best_gb_s": nbytes / min(found) / 1e9}
        row["speedup_best"] = min(times["before"]) / min(times["after"])
        row["speedup_median"] = statistics.median(times["before"]) / statistics.median(times["after"])
        extra = ""
        if "w4a16" in times:
            row["w4a16_over_after_median"] = statistics.median(times["w4a16"]) / statistics.median(times["after"])
            extra = (f"; W4A16 {row['w4a16']['best_ms']:.3f} ms ({row['w4a16']['best_gb_s']:.1f} GB/s), "
                     f"W4A8 after {row['w4a16_over_after_median']:.2f}x it (median)")
        rows.append(row)
        print(f"M={m} {k}x{n} {dtype}: before {row['before']['best_ms']:.3f} ms ({row['before']['best_gb_s']:.1f} "
              f"GB/s), after {row['after']['best_ms']:.3f} ms ({row['after']['best_gb_s']:.1f} GB/s); "
              f"{row['speedup_best']:.2f}x best, {row['speedup_median']:.2f}x median{extra}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="hal_cpu/_kernels.so built from the commit to compare against")
    parser.add_argument("--kernel", default="w4a16", choices=tuple(SYMBOLS))
    parser.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--rows", type=int, help="run every shape at this M instead of the built-in M")
    parser.add_argument("--json", help="write the rows and the copy bandwidth here")
    args = parser.parse_args(argv)
    native = _native.load()
    copy = copy_bandwidth(native.threads, 5)
    print(f"copy bandwidth {copy / 1e9:.1f} GB/s ({native.threads} threads); variant {native.isa}")
    rows = compare(args.before, args.dtype, args.rounds, args.kernel, args.rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gb_s": copy / 1e9, "isa": native.isa, "threads": native.threads, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
