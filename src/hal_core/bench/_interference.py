"""What a small torch op between two calls costs an op: the op alone against the op alternating with ``torch.mm``.

Engines run hal's ops between torch's (norms, residual adds, sampling). A
runtime whose threads keep polling for work after each of its ops (torch's
OpenMP team does by default) can take the cores an op's own threads need, and
the op then runs at a fraction of its speed. For each op of
:data:`INTERFERENCE_OPS`, in its default bench case (for ``quantized_gemm``
the decode GEMV of a 7B layer, W4A16 M=1 4096x11008), the wall time of one call
is measured alone and right after a small ``torch.mm`` on host tensors (64x256
by 256x256; the ``torch.mm`` itself is not timed), in interleaved rounds, and
the medians are compared: ``ratio`` = alternating / alone, 1 meaning no
interference. Wall time, because the loss is the wait for threads that lost
their cores, which thread CPU time does not show. Host backends only.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ops import OPS

__all__ = ["INTERFERENCE_OPS", "TORCH_OP", "format_interference", "measure_interference"]

#: The ops timed beside torch (each in its default bench case unless ``cases`` says otherwise).
INTERFERENCE_OPS = ("quantized_gemm",)
#: The torch op run before each alternating call: ``torch.mm`` of these shapes, float32 host tensors.
TORCH_OP = ((64, 256), (256, 256))


def _wall_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_interference(backend: Any, *, rounds: int = 3, calls: int = 20,
                         cases: Mapping[str, Mapping[str, Any]] | None = None,
                         rng: np.random.Generator | None = None) -> list[dict[str, Any]]:
    """Per op of :data:`INTERFERENCE_OPS`: the median wall ms of a call alone and right after ``torch.mm``.

    ``cases`` overrides an op's bench parameters (``{"quantized_gemm": {"k": 256, ...}}``). Each of
    ``rounds`` rounds times ``calls`` calls alone, then ``calls`` alternating. A row says ``note``
    instead of figures when torch is not installed or no implementation supports the case.
    """
    rng = rng or np.random.default_rng(0)
    if importlib.util.find_spec("torch") is None:
        return [{"op": op, "note": "torch is not installed"} for op in INTERFERENCE_OPS]
    import torch

    a, b = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for shape in TORCH_OP)
    rows = []
    for op in INTERFERENCE_OPS:
        spec = OPS[op]
        assert spec.bench is not None  # every op of INTERFERENCE_OPS declares bench cases
        params = {**spec.bench.params, **(cases or {}).get(op, {})}
        args = spec.bench.inputs(rng, params)
        impl, _ = backend.ops.choose(backend.ops.prepare(op, **args))
        if impl is None:
            rows.append({"op": op, "case": params, "note": "no implementation of the backend supports the case"})
            continue
        front = getattr(backend.ops, op)

        def call(f: Callable[..., Any] = front, kw: dict[str, Any] = args) -> Any:
            return f(**kw)

        def alternating(c: Callable[[], Any] = call) -> float:
            torch.mm(a, b)
            return _wall_ms(c)

        for _ in range(3):
            alternating()  # warm up both
        alone: list[float] = []
        mixed: list[float] = []
        for _ in range(rounds):
            alone += [_wall_ms(call) for _ in range(calls)]
            mixed += [alternating() for _ in range(calls)]
        alone_ms, mixed_ms = statistics.median(alone), statistics.median(mixed)
        row: dict[str, Any] = {"op": op, "implementation": impl.name, "case": params,
                               "torch_op": "mm " + " x ".join("x".join(map(str, s)) for s in TORCH_OP),
                               "calls": len(alone), "alone_ms": alone_ms, "alternating_ms": mixed_ms,
                               "ratio": mixed_ms / alone_ms}
        rows.append(row)
    return rows


def format_interference(rows: list[dict[str, Any]]) -> str:
    """The interference rows as a table."""
    lines = [f"{'beside torch (wall, median)':<30} {'alone':>10} {'after torch.mm':>15} {'ratio':>7}", "-" * 65]
    for row in rows:
        if "note" in row:
            lines.append(f"{row['op']:<30} {row['note']}")
            continue
        lines.append(f"{row['op']:<30} {row['alone_ms']:>7.3f} ms {row['alternating_ms']:>12.3f} ms "
                     f"{row['ratio']:>7.2f}")
    shapes = " by ".join("x".join(map(str, shape)) for shape in TORCH_OP)
    lines.append(f"each call timed alone and right after a torch.mm ({shapes}); ratio 1: torch's threads leave "
                 "the op its cores")
    return "\n".join(lines)
