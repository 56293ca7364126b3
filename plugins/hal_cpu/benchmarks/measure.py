"""Times hal-cpu's kernels against the machine's limits and torch's CPU kernels, all in one process.

Usage: ``python plugins/hal_cpu/benchmarks/measure.py [--repeat N] [--quick] [--json PATH]``

Reported per case: the median time over ``--repeat`` runs after a warm-up,
the effective bandwidth or FLOP rate, and ratios to (a) the copy bandwidth
(a large ``np.copyto`` on every core, read + write bytes) and the fp32 BLAS
rate (numpy ``matmul`` at M=256), both measured in this run, and (b) torch's
peers measured in this run (``scaled_dot_product_attention(enable_gqa=True)``
on contiguous K/V; ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``
with bf16 activations). torch is optional: without it the peer columns are
empty. Shared machines are noisy: compare ratios from one run, and repeat.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import paged_attention, quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.quant import QuantizedWeight, quantize

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
ATTENTION = [(8, 512), (32, 512), (8, 4096), (32, 4096), (1, 32768)]
GEMM_SHAPES = [(4096, 11008), (11008, 4096)]
DTYPES = {"fp16": np.float16, "bf16": BFLOAT16, "fp32": np.float32}


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(threads: int, repeat: int) -> float:
    """Bytes per second (read + write) of a 256 MiB copy split over ``threads`` threads."""
    src = np.ones(64 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]

    def copy() -> None:
        workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds[1:]]
        for w in workers:
            w.start()
        np.copyto(dst[bounds[0][0]:bounds[0][1]], src[bounds[0][0]:bounds[0][1]])
        for w in workers:
            w.join()

    return 2 * src.nbytes / timed(copy, repeat)


def blas_rate(repeat: int) -> float:
    """FLOP/s of numpy's fp32 matmul at the M=256 GEMM shape."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4096), dtype=np.float32)
    w = rng.standard_normal((4096, 11008), dtype=np.float32)
    return 2 * 256 * 4096 * 11008 / timed(lambda: x @ w, repeat)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def attention_cases(rng: np.random.Generator, repeat: int, copy_bw: float, torch: Any, dtypes: list[str],
                    shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        for seqs, length in shapes:
            blocks = seqs * length // BLOCK
            shape = (blocks, KV_HEADS, BLOCK, HEAD_SIZE)
            kc = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            vc = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            q = rng.standard_normal((seqs, HEADS, HEAD_SIZE), dtype=np.float32).astype(dtype)
            tables = rng.permutation(blocks).astype(np.int32).reshape(seqs, -1)
            lens = np.full(seqs, length, dtype=np.int32)
            scale = HEAD_SIZE ** -0.5
            args = (q, kc, vc, tables, lens, scale)
            t = timed(lambda args=args: paged_attention.attend(*args), repeat)
            nbytes = 2 * seqs * length * KV_HEADS * HEAD_SIZE * kc.itemsize
            row = {"op": "paged_attention", "dtype": name, "shape": f"{seqs}x{length}", "ms": t * 1e3,
                   "GB/s": nbytes / t / 1e9, "of_copy_bw": nbytes / t / copy_bw}
            del args, kc, vc  # free the caches before the peer's copies are made
            if torch is not None:
                tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]
                tq = torch.randn(seqs, HEADS, 1, HEAD_SIZE, dtype=tdtype)
                tk = torch.randn(seqs, KV_HEADS, length, HEAD_SIZE, dtype=tdtype)
                tv = torch.randn(seqs, KV_HEADS, length, HEAD_SIZE, dtype=tdtype)
                fn = torch.nn.functional.scaled_dot_product_attention
                with torch.inference_mode():
                    tt = timed(lambda fn=fn, tq=tq, tk=tk, tv=tv: fn(tq, tk, tv, enable_gqa=True), repeat)
                row["torch_ms"] = tt * 1e3
                row["vs_torch"] = tt / t
                del tk, tv
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


def _torch_int4(torch: Any, qw: QuantizedWeight) -> Callable[[Any], Any]:
    """torch's int4 CPU kernel on the same codes, scales and zero points (bf16 activations)."""
    codes = torch.from_numpy(qw.codes().T.astype(np.int32).copy()).clone()  # [N, K], torch-aligned
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    scales = torch.from_numpy(np.asarray(qw.scales).astype(np.float32))  # [K/G, N]
    # torch dequantises (q - 8) * s + zero: zero = (8 - z) * s for the asymmetric case
    zero = (8 - qw.default_zero) * scales
    sz = torch.stack([scales, zero], dim=-1).to(torch.bfloat16).contiguous()
    g = qw.group_size
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)


def gemm_cases(rng: np.random.Generator, repeat: int, copy_bw: float, blas: float, torch: Any,
               ms: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k, n in GEMM_SHAPES:
        w = rng.standard_normal((k, n), dtype=np.float32) / np.float32(np.sqrt(k))
        for bits in (4, 8):
            qw = quantize(w, bits=bits, group_size=128)
            packed = np.asarray(qw.qweight).nbytes
            peer = None
            if torch is not None:
                if bits == 4:
                    peer = _torch_int4(torch, qw)
                else:
                    w8 = torch.from_numpy((qw.codes().astype(np.int16) - 128).T.astype(np.int8).copy()).clone()
                    s8 = torch.ones(n, dtype=torch.bfloat16)
                    peer = lambda x, w8=w8, s8=s8: torch.ops.aten._weight_int8pack_mm(x, w8, s8)  # noqa: E731
            for m in ms:
                x = rng.uniform(-1, 1, (m, k)).astype(np.float32).astype(BFLOAT16)
                t = timed(lambda x=x, qw=qw: quantized_gemm.gemm(x, qw), repeat)
                flops = 2 * m * k * n
                row = {"op": f"W{bits}A{16 if bits == 4 else 8}", "shape": f"{k}x{n}", "M": m, "ms": t * 1e3,
                       "weight_GB/s": packed / t / 1e9, "of_copy_bw": packed / t / copy_bw,
                       "GFLOP/s": flops / t / 1e9, "of_blas": flops / t / blas}
                if peer is not None:
                    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).clone()  # torch-aligned
                    with torch.inference_mode():
                        tt = timed(lambda peer=peer, tx=tx: peer(tx), repeat)
                    row["torch_ms"] = tt * 1e3
                    row["vs_torch"] = tt / t
                rows.append(row)
                print(_fmt(row), flush=True)
    return rows


def rss_case(count: int, m: int) -> dict[str, Any]:
    """Peak RSS growth (MiB) over what is resident once the weights exist, calling ``count`` distinct 4096x11008
    W4A16 weights once each (the peak is reset through /proc/self/clear_refs first; Linux only)."""
    code = f"""
import numpy as np
from hal_core.quant import QuantizedWeight
from hal_cpu.ops import quantized_gemm
rng = np.random.default_rng(0)
k, n, g = 4096, 11008, 128
# filled in place (no temporaries that would raise the peak before the calls)
weights = [QuantizedWeight(np.full((k // 8, n), 0x89ABCDEF + i, np.uint32), np.full((k // g, n), 0.01, np.float16),
                           None, 4, g, (k, n)) for i in range({count})]
x = rng.uniform(-1, 1, ({m}, k)).astype(np.float16)
status = lambda key: int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to what is resident now
    f.write("5")
before = status("VmRSS")  # the weights and x exist; no call yet
for w in weights:
    quantized_gemm.gemm(x, w)
after = status("VmHWM")
print((after - before) / 1024, sum(w.nbytes for w in weights) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    row = {"op": "rss", "M": m, "weights": count, "peak_rss_growth_MiB": float(out[0]), "weights_MiB": float(out[1])}
    print(_fmt(row), flush=True)
    return row


def _fmt(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (fp16 attention, M=1 and 256)")
    parser.add_argument("--only", choices=["attention", "gemm", "rss"], action="append")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    native = _native.load()
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(native.threads)
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth(native.threads, args.repeat)
    copy_bw_1 = copy_bandwidth(1, args.repeat)
    blas = blas_rate(args.repeat)
    print(f"isa={native.isa} threads={native.threads} copy={copy_bw / 1e9:.1f} GB/s "
          f"(1 thread {copy_bw_1 / 1e9:.1f}) fp32 BLAS={blas / 1e9:.0f} GFLOP/s "
          f"torch={getattr(torch, '__version__', 'absent')}", flush=True)
    only = set(args.only or ["attention", "gemm", "rss"])
    rows: list[dict[str, Any]] = []
    if "attention" in only:
        dtypes = ["fp16"] if args.quick else list(DTYPES)
        shapes = [(8, 512), (32, 4096), (1, 32768)] if args.quick else ATTENTION
        rows += attention_cases(rng, args.repeat, copy_bw, torch, dtypes, shapes)
    if "gemm" in only:
        rows += gemm_cases(rng, args.repeat, copy_bw, blas, torch, [1, 256] if args.quick else [1, 16, 256])
    if "rss" in only:
        rows += [rss_case(20, 1), rss_case(20, 256)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": native.isa, "threads": native.threads, "copy_bw": copy_bw, "copy_bw_1": copy_bw_1,
                       "blas_flops": blas, "torch": getattr(torch, "__version__", None),
                       "maxrss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
