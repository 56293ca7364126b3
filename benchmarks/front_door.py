"""What the ops front door costs per call: ``be.ops.<op>(...)`` against a direct call of the implementation.

The front door is everything between the caller and the kernel: interop,
device checks, validation (with the default index checks), the choice of
implementation, the result check and ``out``. Tiny inputs make the kernel
negligible, so the difference is the door itself. Both sides run in the
same process, interleaved; each figure is the median over batches of the
thread's CPU time (wall time on a loaded machine counts other processes),
and the best of three interleaved rounds is reported.

Usage: ``python benchmarks/front_door.py [--backend NAME] [--repeats N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import hal_core
from hal_core.ops import OPS, OpCall
from hal_core.quant import quantize
from hal_core.testing.inputs import paged_attention_inputs, write_kv_cache_inputs


def _per_call_us(fn: Callable[[], Any], repeats: int, inner: int = 200) -> float:
    """Median over ``repeats`` batches of the thread CPU time of one call, in microseconds.

    CPU time of this thread, not wall time: on a shared machine the time the
    scheduler gives other processes is not counted against either side.
    """
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        samples.append((time.thread_time() - start) / inner * 1e6)
    return statistics.median(samples)


def _cases(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    attention = paged_attention_inputs(rng, seq_lens=[8], num_heads=4, num_kv_heads=1, head_size=64,
                                       block_size=16, dtype="fp32")
    x = rng.standard_normal((1, 64)).astype(np.float32)
    qweight = quantize(rng.standard_normal((64, 16)) / 8, group_size=32)
    write = write_kv_cache_inputs(rng, num_tokens=2, num_blocks=2, num_kv_heads=1, block_size=16, head_size=64,
                                  dtype="fp32")
    return {
        "paged_attention": {**attention, "out": None},
        "quantized_gemm": {"x": x, "qweight": qweight, "out": None},
        "write_kv_cache": {k: write[k] for k in ("key", "value", "key_cache", "value_cache", "slot_mapping")},
    }


def measure(backend_name: str | None = None, repeats: int = 31) -> list[dict[str, Any]]:
    """Per op: microseconds per call through the front door, directly, and the difference."""
    backend = hal_core.get_backend(backend_name)
    rows = []
    for op, args in _cases(np.random.default_rng(0)).items():
        call = backend.ops.prepare(op, **args)
        impl, _ = backend.ops.choose(call)
        if impl is None:
            rows.append({"op": op, "note": "no implementation of the backend supports the case"})
            continue
        impl_call = call
        front = getattr(backend.ops, op)
        kwargs = {k: v for k, v in args.items() if k not in ("scale", "out")}
        if op == "paged_attention":
            def through(kw=kwargs, s=args["scale"], f=front): return f(**kw, scale=s)
        else:
            def through(kw=kwargs, f=front): return f(**kw)

        def direct(fn=impl.fn, c=impl_call):  # a fresh request each time, as the door makes one
            return fn(OpCall(spec=c.spec, args=dict(c.args), backend=c.backend))

        spec = OPS[op]

        def validate(s=spec, a=args, t=backend.to_numpy): return s.validate(dict(a), t)

        through(), direct()  # warm up
        door, bare, checks = [], [], []
        for _ in range(3):  # interleave, so drift hits both sides alike
            door.append(_per_call_us(through, repeats))
            bare.append(_per_call_us(direct, repeats))
            checks.append(_per_call_us(validate, repeats))
        door_us, bare_us, validate_us = min(door), min(bare), min(checks)
        rows.append({"op": op, "implementation": impl.name, "front_door_us": door_us, "direct_us": bare_us,
                     "overhead_us": door_us - bare_us, "validation_us": validate_us,
                     "dispatch_us": door_us - bare_us - validate_us})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="backend name (default: the best available)")
    parser.add_argument("--repeats", type=int, default=31, help="batches per measurement (default 31)")
    args = parser.parse_args()
    print(f"{'op':<18} {'implementation':<22} {'front door':>11} {'direct':>9} {'overhead':>9} "
          f"{'of which validation':>20} {'the rest':>9}")
    for row in measure(args.backend, args.repeats):
        if "note" in row:
            print(f"{row['op']:<18} {row['note']}")
            continue
        print(f"{row['op']:<18} {row['implementation']:<22} {row['front_door_us']:>9.1f}us "
              f"{row['direct_us']:>7.1f}us {row['overhead_us']:>7.1f}us {row['validation_us']:>18.1f}us "
              f"{row['dispatch_us']:>7.1f}us")


if __name__ == "__main__":
    main()
