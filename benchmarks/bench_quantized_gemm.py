"""quantized_gemm W4A16 (G=128) on the CUDA backend: speed-up over a CuPy fp16 matmul on unquantised weights.

Shapes ``[K, N]``: 4096x4096, 4096x11008, 8192x28672; M = 1, 16, 64, 1024, 4096.
L2 is flushed before every timed run (a write of twice its size). Both sides are
timed as CUDA-graph replays of one call (device time; the Python-call times are
reported beside them). Targets:
>= 3x at M <= 16 on the two large shapes, >= 2x at M = 64, >= 1/1.1 at M >= 1024.
For M = 64 the fused small-M kernel is also timed (``HAL_CUDA_SMALL_M_MAX=64``),
to place the fused/dequantise threshold. A host-offload sweep times numpy
inputs on the CPU backend against the CUDA backend to place
``HAL_CUDA_OFFLOAD_MIN_FLOPS``.

Usage: ``python benchmarks/bench_quantized_gemm.py [--json PATH] [--repeat N] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_bench import (
    capture_graph,
    device_summary,
    gemm_target,
    l2_flusher,
    median_ms,
    ratio,
    time_ms,
    verdict,
    write_json,
)

SHAPES = ((4096, 4096), (4096, 11008), (8192, 28672))
LARGE = {(4096, 11008), (8192, 28672)}
MS = (1, 16, 64, 1024, 4096)
GROUP = 128


def random_w4(cp: Any, k: int, n: int) -> Any:
    """A random symmetric W4A16 weight (G=128) built on the device (codes uniform in 0..15)."""
    from hal_core.quant import QuantizedWeight

    packed = cp.random.randint(0, 256, size=(k // 8, n * 4), dtype=cp.uint8).view(cp.uint32)
    scales = (cp.random.random_sample((k // GROUP, n), dtype=cp.float32) * 0.01 + 0.001).astype(cp.float16)
    return QuantizedWeight(qweight=packed, scales=scales, zeros=None, bits=4, group_size=GROUP, shape=(k, n))


def dequantize_on_device(cp: Any, qw: Any) -> Any:
    """fp32 ``[K, N]`` weights of a symmetric int4 QuantizedWeight, computed with CuPy (for checks)."""
    k, n = qw.shape
    shifts = (4 * cp.arange(8, dtype=cp.uint32))[None, :, None]
    codes = ((qw.qweight[:, None, :] >> shifts) & cp.uint32(15)).reshape(k, n).astype(cp.float32)
    scales = cp.repeat(qw.scales.astype(cp.float32), qw.group_size, axis=0)
    return (codes - 8.0) * scales


def device_and_call_ms(cp: Any, fn: Any, repeat: int, flush: Any) -> tuple[float, float, str]:
    """(device ms from a graph replay, or the call time if capture failed; Python-call ms; capture error)."""
    call = median_ms(time_ms(cp, fn, repeat=repeat, before=flush))
    replay, why = capture_graph(cp, fn)
    if replay is None:
        return call, call, why
    return median_ms(time_ms(cp, replay, warmup=2, repeat=repeat, before=flush)), call, ""


def _path(be: Any, m: int) -> str:
    """Which quantized_gemm path serves M rows of fp16 W4A16 on this device (see hal_cupy.ops._quantized_gemm)."""
    from hal_cupy.ops._quantized_gemm import uses_small_m, uses_tensor_cores

    if uses_tensor_cores(be, 0, "fp16", 4, m):
        return "tensor-core"
    return "fused" if uses_small_m(m, be.name) else "k-slabs+cublas"


def bench_shape(cp: Any, be: Any, k: int, n: int, repeat: int, flush: Any) -> list[dict[str, Any]]:
    qw = random_w4(cp, k, n)
    w32 = dequantize_on_device(cp, qw)
    w16 = w32.astype(cp.float16)  # the unquantised weights cuBLAS multiplies
    rows = []
    for m in MS:
        x = (cp.random.standard_normal((m, k), dtype=cp.float32) * 0.5).astype(cp.float16)
        out = cp.empty((m, n), dtype=cp.float16)
        ref_out = cp.empty((m, n), dtype=cp.float16)

        def quant(x: Any = x, out: Any = out) -> None:
            be.ops.quantized_gemm(x, qw, out=out)

        def dense(x: Any = x, ref_out: Any = ref_out) -> None:
            cp.matmul(x, w16, out=ref_out)

        quant()
        want = x.astype(cp.float32) @ w32
        err = float(cp.linalg.norm(out.astype(cp.float32) - want) / cp.linalg.norm(want))
        t_q, call_q, why_q = device_and_call_ms(cp, quant, repeat, flush)
        t_ref, call_ref, why_ref = device_and_call_ms(cp, dense, repeat, flush)
        speedup = ratio(t_ref, t_q)
        target = gemm_target(m, (k, n) in LARGE)
        row = {"k": k, "n": n, "m": m, "path": _path(be, m),
               "ms": t_q, "fp16_matmul_ms": t_ref, "speedup": speedup, "target": target,
               "verdict": verdict(speedup, target), "call_ms": call_q, "fp16_matmul_call_ms": call_ref,
               "call_speedup": ratio(call_ref, call_q), "graph_error": why_q or why_ref,
               "rel_error": err, "correct": err < 2e-3}
        if m == 64:  # the other side of the small-M threshold
            os.environ["HAL_CUDA_SMALL_M_MAX"] = "64"
            try:
                quant()
                row["fused_ms"] = device_and_call_ms(cp, quant, repeat, flush)[0]
            finally:
                del os.environ["HAL_CUDA_SMALL_M_MAX"]
        rows.append(row)
        del x, out, ref_out, want
    return rows


def offload_sweep(be: Any, repeat: int = 5) -> list[dict[str, Any]]:
    """Wall-clock of host (numpy) W4A16 calls: CPU backend vs offloaded to the GPU, by FLOPs."""
    import hal_core
    from hal_core.quant import quantize

    cpu = hal_core.get_backend("cpu")
    rng = np.random.default_rng(7)
    rows = []
    os.environ["HAL_CUDA_OFFLOAD_MIN_FLOPS"] = "0"
    try:
        for k, n, m in ((256, 256, 1), (1024, 1024, 1), (1024, 1024, 16), (4096, 4096, 1), (4096, 4096, 16)):
            qw = quantize(rng.standard_normal((k, n)).astype(np.float32))
            x = rng.standard_normal((m, k)).astype(np.float16)
            timings = {}
            for label, backend in (("cpu", cpu), ("offload", be)):
                backend.ops.quantized_gemm(x, qw)
                start = time.perf_counter()
                for _ in range(repeat):
                    backend.ops.quantized_gemm(x, qw)
                timings[label] = (time.perf_counter() - start) / repeat * 1e3
            rows.append({"k": k, "n": n, "m": m, "flops": 2 * m * k * n, "cpu_ms": timings["cpu"],
                         "offload_ms": timings["offload"], "offload_wins": timings["offload"] < timings["cpu"]})
    finally:
        del os.environ["HAL_CUDA_OFFLOAD_MIN_FLOPS"]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="first shape only, no offload sweep")
    args = parser.parse_args(argv)
    import cupy as cp

    import hal_core

    be = hal_core.get_backend("cuda")
    shapes = SHAPES[:1] if args.quick else SHAPES
    with cp.cuda.Stream(non_blocking=True):  # graphs cannot be captured on the legacy default stream
        flush = l2_flusher(cp, be.device(0).capabilities.l2_bytes)
        rows = [row for k, n in shapes for row in bench_shape(cp, be, k, n, args.repeat, flush)]
    sweep = [] if args.quick else offload_sweep(be)
    payload = {"benchmark": "quantized_gemm", "device": device_summary(cp), "group_size": GROUP, "rows": rows,
               "offload": sweep}
    if args.json:
        write_json(args.json, payload)
    for r in rows:
        extra = f"  fused {r['fused_ms']:.3f} ms" if "fused_ms" in r else ""
        print(f"W4A16 {r['k']}x{r['n']} M={r['m']:>4} {r['path']:>14}: {r['ms']:.3f} ms vs fp16 "
              f"{r['fp16_matmul_ms']:.3f} ms  x{r['speedup']:.2f} (target {r['target'] or '-'}) {r['verdict']}"
              f"  [calls x{r['call_speedup']:.2f}]  err {r['rel_error']:.1e}{extra}")
    for r in sweep:
        print(f"offload {r['k']}x{r['n']} M={r['m']} {r['flops']:.2e} FLOP: cpu {r['cpu_ms']:.2f} ms, "
              f"gpu {r['offload_ms']:.2f} ms")
    return payload


if __name__ == "__main__":
    main()
