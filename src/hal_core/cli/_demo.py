"""``hal demo``: a few decode steps over a paged KV cache, each op checked against its reference."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import hal_core
from hal_core import HalError
from hal_core.arrays import numpy_dtype
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize

#: The kind of each op in the tolerance table of hal_core.testing.tolerances.
_TOLERANCE_KIND = {"quantized_gemm": "gemm", "paged_attention": "attention", "write_kv_cache": "copy"}
_DTYPES = ("bf16", "fp16", "fp32")


@dataclass
class OpResult:
    """Timings and errors of one op of the demo, over every decode step."""

    label: str
    op: str
    shapes: str = ""
    times_ms: list[float] = field(default_factory=list)
    nbytes: int = 0
    max_error: float = 0.0
    tolerance: tuple[float, float] = (0.0, 0.0)
    ok: bool = True

    @property
    def ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.ms * 1e6) if self.times_ms and self.ms > 0 else float("nan")


def _tolerance(op: str, dtype: str) -> tuple[float, float]:
    """(atol, rtol) of ``op`` in ``dtype``: the contract suite's table (hal_core.testing.tolerances)."""
    from hal_core.testing.tolerances import tolerance

    return tolerance(_TOLERANCE_KIND[op], dtype)


def _compare(result: OpResult, actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    atol, rtol = result.tolerance = _tolerance(result.op, dtype)
    diff = np.abs(np.asarray(actual).astype(np.float64) - expected)
    result.max_error = max(result.max_error, float(diff.max()) if diff.size else 0.0)
    result.ok = result.ok and bool(np.all(diff <= atol + rtol * np.abs(expected)))


class _Demo:
    """One run of ``hal demo``: a paged KV cache and a few checked decode steps."""

    def __init__(self, backend: hal_core.Backend, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.be, self.a, self.log = backend, args, log
        self.rng = np.random.default_rng(args.seed)
        self.dtype = numpy_dtype(args.dtype)
        self.results = {
            "qkv": OpResult("qkv_proj", "quantized_gemm"),
            "write": OpResult("write_kv", "write_kv_cache"),
            "attn": OpResult("attention", "paged_attention"),
            "out": OpResult("o_proj", "quantized_gemm"),
        }

    # setup ------------------------------------------------------------

    def _weights(self, k: int, n: int) -> QuantizedWeight:
        w = self.rng.standard_normal((k, n)) / math.sqrt(k)
        return quantize(w, bits=4, group_size=self.a.group_size)

    def setup(self) -> None:
        a, rng = self.a, self.rng
        heads, kv, d, bs = a.heads, a.kv_heads, a.head_size, a.block_size
        self.lens = rng.integers(1, a.max_len + 1, size=a.seqs).astype(np.int32)
        final = self.lens + a.steps
        self.max_blocks = int(-(-final.max() // bs))
        num_blocks = int((-(-final // bs)).sum()) + a.seqs
        self.free = list(rng.permutation(num_blocks))  # a shuffled free list
        self.tables = np.zeros((a.seqs, self.max_blocks), dtype=np.int32)
        for s, n in enumerate(self.lens):
            for j in range(-(-int(n) // bs)):
                self.tables[s, j] = self.free.pop()
        shape = (num_blocks, kv, bs, d)
        kc, vc = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        for s, n in enumerate(self.lens):
            t = np.arange(int(n))
            blocks, offs = self.tables[s, t // bs], t % bs
            kc[blocks, :, offs] = rng.standard_normal((int(n), kv, d)).astype(self.dtype)
            vc[blocks, :, offs] = rng.standard_normal((int(n), kv, d)).astype(self.dtype)
        self.k_cache, self.v_cache = self.be.asarray(kc), self.be.asarray(vc)
        self.log(f"built a paged KV cache: {a.seqs} sequences of lengths {int(self.lens.min())}.."
                 f"{int(self.lens.max())}, {num_blocks} blocks of {bs} tokens ({2 * kc.nbytes / 2**20:.1f} MiB)")
        self.w_qkv = self._weights(a.hidden, (heads + 2 * kv) * d)
        self.w_o = self._weights(heads * d, a.hidden)
        self.dev_w_qkv = self.w_qkv.map_arrays(self.be.asarray)
        self.dev_w_o = self.w_o.map_arrays(self.be.asarray)
        self.activations = self.be.ops.prepare("quantized_gemm", x=np.zeros((a.seqs, a.hidden), self.dtype),
                                               qweight=self.w_qkv, activations="auto").args["activations"]
        self.log(f"quantised int4 projections: qkv {self.w_qkv.shape}, o {self.w_o.shape}, "
                 f"group size {a.group_size}; activations='auto' runs them "
                 f"{'W4A8' if self.activations == 'int8' else 'W4A16'} at M = {a.seqs}")

    # one op, timed and checked -----------------------------------------

    def _run(self, key: str, fn: Callable[[], Any], host_args: dict[str, Any], shapes: str) -> Any:
        result = self.results[key]
        spec = OPS[result.op]
        device = self.be.device(0)
        device.synchronize()
        start = time.perf_counter()
        out = fn()
        device.synchronize()
        result.times_ms.append((time.perf_counter() - start) * 1e3)
        result.nbytes = spec.nbytes(host_args)
        result.shapes = shapes
        expected = spec.reference(host_args)
        if spec.inplace_args:
            for name, ref in zip(spec.inplace_args, expected, strict=True):
                _compare(result, self.be.to_numpy(host_args[f"_{name}_after"]), ref, self.a.dtype)
        else:
            _compare(result, self.be.to_numpy(out), expected, self.a.dtype)
        return out

    def _host(self, array: Any) -> np.ndarray:
        return np.array(self.be.to_numpy(array), copy=True)

    def step(self) -> None:
        a, be = self.a, self.be
        heads, kv, d, bs, n = a.heads, a.kv_heads, a.head_size, a.block_size, a.seqs
        # New slots: a sequence crossing a block boundary takes a block from the free list.
        slots = np.empty(n, dtype=np.int32)
        for s in range(n):
            pos = int(self.lens[s])
            if pos % bs == 0:
                self.tables[s, pos // bs] = self.free.pop()
            slots[s] = self.tables[s, pos // bs] * bs + pos % bs

        x = self.rng.standard_normal((n, a.hidden)).astype(self.dtype)
        dx = be.asarray(x)  # copies to the device stay outside the timed calls
        qkv = self._run("qkv", lambda: be.ops.quantized_gemm(dx, self.dev_w_qkv, activations="auto"),
                        {"x": x, "qweight": self.w_qkv, "activations": self.activations},
                        f"x[{n},{a.hidden}] @ int4[{a.hidden},{(heads + 2 * kv) * d}]")
        host = self._host(qkv)
        q = np.ascontiguousarray(host[:, : heads * d].reshape(n, heads, d))
        k = np.ascontiguousarray(host[:, heads * d: (heads + kv) * d].reshape(n, kv, d))
        v = np.ascontiguousarray(host[:, (heads + kv) * d:].reshape(n, kv, d))

        kc_before, vc_before = self._host(self.k_cache), self._host(self.v_cache)
        dk, dv, dslots = be.asarray(k), be.asarray(v), be.asarray(slots)
        self._run("write", lambda: be.ops.write_kv_cache(dk, dv, self.k_cache, self.v_cache, dslots),
                  {"key": k, "value": v, "key_cache": kc_before, "value_cache": vc_before, "slot_mapping": slots,
                   "_key_cache_after": self.k_cache, "_value_cache_after": self.v_cache},
                  f"k,v[{n},{kv},{d}] -> cache[{','.join(map(str, kc_before.shape))}]")
        self.lens += 1

        scale = 1.0 / math.sqrt(d)
        kc_host, vc_host = self._host(self.k_cache), self._host(self.v_cache)
        tables, lens = self.tables.copy(), self.lens.copy()
        dq, dtables, dlens = be.asarray(q), be.asarray(tables), be.asarray(lens)
        attn = self._run(
            "attn",
            lambda: be.ops.paged_attention(dq, self.k_cache, self.v_cache, dtables, dlens, scale=scale),
            {"query": q, "key_cache": kc_host, "value_cache": vc_host, "block_tables": tables,
             "seq_lens": lens, "scale": scale},
            f"q[{n},{heads},{d}] ctx {int(lens.min())}..{int(lens.max())}",
        )
        flat = np.ascontiguousarray(self._host(attn).reshape(n, heads * d))
        dflat = be.asarray(flat)
        self._run("out", lambda: be.ops.quantized_gemm(dflat, self.dev_w_o, activations="auto"),
                  {"x": flat, "qweight": self.w_o, "activations": self.activations},
                  f"x[{n},{heads * d}] @ int4[{heads * d},{a.hidden}]")


def run_demo(backend: hal_core.Backend, args: argparse.Namespace, log: Callable[[str], None]) -> list[OpResult]:
    """Run the demo on ``backend``; return one :class:`OpResult` per op."""
    demo = _Demo(backend, args, log)
    demo.setup()
    for step in range(args.steps):
        log(f"step {step + 1}/{args.steps}: qkv projection, write_kv_cache, paged_attention, o projection")
        demo.step()
    return list(demo.results.values())


def _print_table(backend: str, dtype: str, results: Sequence[OpResult]) -> None:
    headers = ("backend", "op", "kernel", "shapes", "time ms", "GB/s", "max error", "atol/rtol", "ok")
    rows = [
        (backend, r.label, r.op, r.shapes, f"{r.ms:.3f}", f"{r.gbps:.2f}", f"{r.max_error:.2e}",
         f"{r.tolerance[0]:g}/{r.tolerance[1]:g}", "yes" if r.ok else "NO")
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(f"(dtype {dtype}; time is the median over decode steps; GB/s = op bytes / time)")


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    problems = []
    if args.heads % args.kv_heads:
        problems.append(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.hidden % args.group_size or (args.heads * args.head_size) % args.group_size:
        problems.append(f"--group-size {args.group_size} must divide --hidden and heads*head-size")
    if min(args.seqs, args.max_len, args.heads, args.kv_heads, args.head_size, args.block_size, args.steps) < 1:
        problems.append("sizes must be >= 1")
    if problems:
        print("hal demo: " + "; ".join(problems), file=sys.stderr)
        return 2

    def log(message: str) -> None:
        if not args.quiet:
            print(f"hal demo: {message}", file=sys.stderr, flush=True)

    try:
        backend = hal_core.get_backend(args.backend)
    except HalError as exc:
        print(f"hal demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"hal demo on backend {backend.name!r} ({backend.device(0).capabilities.name}), seed {args.seed} "
          f"(rerun with --seed {args.seed})")
    start = time.perf_counter()
    results = run_demo(backend, args, log)
    log(f"done in {time.perf_counter() - start:.1f} s")
    _print_table(backend.name, args.dtype, results)
    failed = [r.label for r in results if not r.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)} exceeded the {args.dtype} tolerance (seed {args.seed})")
        return 1
    print("all results within tolerance of the float64 reference")
    return 0
