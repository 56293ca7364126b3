"""What a call costs when the caches hold a model's weights instead of hal's code: calls after a stream.

Inside a model, every hal call follows a GEMM that has just streamed megabytes of weights through the
caches, so the interpreter's objects, hal's dispatch and torch's glue are read back from memory on each
call. Back-to-back timings (``benchmarks/call_overhead.py``) see them in the caches and miss that cost.
This benchmark streams ``S`` MB through the caches (a numpy copy between two buffers) before each timed
call, for several ``S``, and times with the wall clock (median over ``--calls`` calls):

- ``get_backend``: ``hal_core.get_backend()``, a few attribute reads of Python: the interpreter alone;
- ``runner``: ``quantized_gemm``'s planned runner for the call's signature, called directly (the
  compiled kernel and its launch, a ``--k`` by ``--n`` int4 weight at one row);
- ``bound``: the same call through a bound op (``backend.ops.bind``): the runner plus hal's dispatch
  (signature, value checks, counters, the result check);
- ``QuantLinear``: ``QuantLinear.forward`` of the same weight on a torch tensor (with torch installed):
  the bound call plus the torch glue (``no_grad``, CPU, eager).

Columns ``+bound`` and ``+linear`` are ``bound - runner`` and ``QuantLinear - bound``. In a 1B-class
model, a layer's GEMMs stream 2-12 MB each.

Usage: ``python benchmarks/cold_calls.py [--sizes 0,2,8,32] [--calls 300] [--k 2048] [--n 512]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import hal_core
from hal_core.quant import quantize


def _median_us(fn: Callable[[], Any], stream: Callable[[], None], calls: int) -> float:
    samples = []
    for _ in range(calls):
        stream()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def _calls(backend: Any, k: int, n: int) -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    weight = quantize(rng.standard_normal((k, n)).astype(np.float32), bits=4, group_size=128)
    x = rng.standard_normal((1, k)).astype(np.float32)
    bound = backend.ops.bind("quantized_gemm", qweight=weight)
    bound(x=x)
    bound(x=x)
    known = next(iter(bound._signatures.values()))  # the kept signature's runner (a benchmark may look inside)
    calls: dict[str, Callable[[], Any]] = {"get_backend": lambda: hal_core.get_backend(backend.name)}
    if known.runner is not None:
        runner, args = known.runner, {"x": x, "qweight": weight}
        calls["runner"] = lambda: runner(dict(args))
    calls["bound"] = lambda: bound(x=x)
    try:
        import torch

        from hal_core.torch import QuantLinear
    except ImportError:
        return calls
    layer = QuantLinear.from_weight(weight)
    xt = torch.from_numpy(x)

    def linear() -> Any:
        with torch.no_grad():
            return layer(xt)

    linear()
    calls["QuantLinear"] = linear
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", help="backend name (default: cpu)")
    parser.add_argument("--sizes", default="0,2,8,32", help="MB streamed before each call, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per figure (median)")
    parser.add_argument("--k", type=int, default=2048, help="the weight's rows (K)")
    parser.add_argument("--n", type=int, default=512, help="the weight's columns (N)")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    backend = hal_core.get_backend(args.backend)
    calls = _calls(backend, args.k, args.n)
    largest = int(max(sizes) * (1 << 20))
    src, dst = np.ones(max(largest, 1), np.uint8), np.empty(max(largest, 1), np.uint8)
    print(f"backend {backend.name}, quantized_gemm int4 {args.k}x{args.n} at one row; median of {args.calls} "
          f"calls, wall clock, microseconds")
    print(f"{'MB':>6} " + " ".join(f"{name:>12}" for name in calls) + f" {'+bound':>8} {'+linear':>8}")
    for size in sizes:
        count = int(size * (1 << 20))

        def stream(count: int = count) -> None:
            if count:
                np.copyto(dst[:count], src[:count])

        us = {name: _median_us(fn, stream, args.calls) for name, fn in calls.items()}
        extra = f" {us['bound'] - us['runner']:>8.1f}" if "runner" in us else f" {'':>8}"
        extra += f" {us['QuantLinear'] - us['bound']:>8.1f}" if "QuantLinear" in us else ""
        print(f"{size:>6g} " + " ".join(f"{value:>12.1f}" for value in us.values()) + extra)


if __name__ == "__main__":
    main()
