"""What a call costs above its kernel: the ops front door, and ``torch.ops.hal``, on the smallest inputs.

For each op that declares a tiny case (:attr:`hal_core.ops.BenchCases.tiny`), four things are timed
on the same inputs, interleaved so drift hits all alike: the registered implementation called
directly on a prepared request (the kernel and its own thin wrapper), ``be.ops.<op>(...)`` (interop,
validation with the default index checks, the choice, the result check, ``out``), the same op bound with
every argument but its first array fixed (:meth:`Ops.bind <hal_core.ops.Ops.bind>`, what a layer calls), and,
when torch is installed, the ``torch.ops.hal`` operator on torch tensors over the same memory (its dispatch, the
backend routing, the numpy views, then the front door). Each figure is the fastest batch of the
thread's CPU time over three interleaved rounds (wall time on a loaded machine counts other
processes, and even CPU time grows with their cache traffic: the fastest batch is the cost itself).
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ops import OPS, OpCall

__all__ = ["measure_overhead"]


def _per_call_us(fn: Callable[[], Any], batches: int, inner: int) -> float:
    samples = []
    for _ in range(batches):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        samples.append((time.thread_time() - start) / inner * 1e6)
    return min(samples)


def _torch_call(op: str, args: dict[str, Any]) -> Callable[[], Any] | None:
    if importlib.util.find_spec("torch") is None:
        return None
    from ..torch import to_tensor, weight_to_tensors
    from ..torch._ops import wrapper

    spec = OPS[op]
    fn = wrapper(spec)
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for arg in spec.args:
        value = args.get(arg.name)
        if arg.is_weight:
            assert value is not None  # a weight is a required argument
            positional += [weight_to_tensors(value), value.bits]
        elif arg.required:
            positional.append(to_tensor(value) if isinstance(value, np.ndarray) else value)
        elif value is not None:
            keywords[arg.name] = to_tensor(value) if isinstance(value, np.ndarray) else value
    return lambda: fn(*positional, **keywords)


def measure_overhead(backend: Any, *, batches: int = 15, inner: int = 100,
                     rng: np.random.Generator | None = None) -> list[dict[str, Any]]:
    """Per op with a tiny case: microseconds of the kernel, the front door and the torch operator.

    ``front_door_us - kernel_us`` is what hal's door adds; ``torch_us - kernel_us`` what a
    ``torch.ops.hal`` call adds (None without torch). A host backend only (the torch side takes
    host tensors).
    """
    rng = rng or np.random.default_rng(0)
    rows = []
    for op, spec in OPS.items():
        bench = spec.bench
        if bench is None or bench.tiny is None:
            continue
        args = bench.inputs(rng, {**bench.params, **bench.tiny})
        call = backend.ops.prepare(op, **args)
        impl, _ = backend.ops.choose(call)
        if impl is None:
            rows.append({"op": op, "note": "no implementation of the backend supports the tiny case"})
            continue
        front = getattr(backend.ops, op)
        keywords = {name: value for name, value in args.items() if spec.arg_named(name).keyword_only}
        positional = [args[a.name] for a in spec.args if not a.keyword_only and a.name in args]

        def direct(fn: Callable[[OpCall], Any] = impl.fn, c: OpCall = call) -> Any:
            return fn(OpCall(spec=c.spec, args=dict(c.args), backend=c.backend))  # a fresh request, as the door makes

        def door(f: Callable[..., Any] = front, p: list[Any] = positional, k: dict[str, Any] = keywords) -> Any:
            return f(*p, **k)

        first = spec.array_names[0]  # what a caller passes anew each call; the rest bound once
        bound_op = backend.ops.bind(op, **{name: value for name, value in args.items() if name != first})

        bound = functools.partial(bound_op, **{first: args[first]})

        through_torch = _torch_call(op, args)
        for fn in (direct, door, bound, through_torch):
            if fn is not None:
                fn()  # warm up
        kernel, front_door, bound_times, torch_op = [], [], [], []
        for _ in range(3):
            kernel.append(_per_call_us(direct, batches, inner))
            front_door.append(_per_call_us(door, batches, inner))
            bound_times.append(_per_call_us(bound, batches, inner))
            if through_torch is not None:
                torch_op.append(_per_call_us(through_torch, batches, inner))
        row = {"op": op, "implementation": impl.name, "case": dict(bench.tiny), "kernel_us": min(kernel),
               "front_door_us": min(front_door), "bound_us": min(bound_times),
               "torch_us": min(torch_op) if torch_op else None}
        row["front_door_overhead_us"] = row["front_door_us"] - row["kernel_us"]
        row["bound_overhead_us"] = row["bound_us"] - row["kernel_us"]
        row["torch_overhead_us"] = None if row["torch_us"] is None else row["torch_us"] - row["kernel_us"]
        rows.append(row)
    return rows


def format_overhead(rows: list[dict[str, Any]]) -> str:
    """The overhead rows as a table."""
    lines = [f"{'per call, tiny inputs':<22} {'kernel':>9} {'front door':>12} {'bound':>11} {'torch.ops.hal':>15}",
             "-" * 73]
    for row in rows:
        if "note" in row:
            lines.append(f"{row['op']:<22} {row['note']}")
            continue
        torch_text = "-" if row["torch_us"] is None else f"+{row['torch_overhead_us']:.1f} us"
        lines.append(f"{row['op']:<22} {row['kernel_us']:>6.1f} us {'+':>3}{row['front_door_overhead_us']:.1f} us "
                     f"{'+' + format(row['bound_overhead_us'], '.1f') + ' us':>11} {torch_text:>15}")
    lines.append("kernel: the implementation called on a prepared request; front door, bound (ops.bind with all but "
                 "the first array fixed) and torch.ops.hal: what each adds to it (thread CPU time)")
    return "\n".join(lines)
