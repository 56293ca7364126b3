"""What a hal call adds to its kernel, per op on its declared tiny case, plus ``QuantLinear.forward``.

Prints ``hal bench``'s overhead rows (:func:`hal_core.bench._overhead.measure_overhead`: the front door
and the ``torch.ops.hal`` operator against the registered implementation called directly) without
running the rest of the bench, then the same for ``QuantLinear.forward`` on the tiny ``quantized_gemm``
case (eager, CPU, no grad) against the implementation called on a prepared request. Every figure is the
fastest batch of the thread's CPU time over interleaved rounds; on a loaded machine compare runs made
back to back. ``--profile OP`` prints a cProfile of the front door (``door``), the torch operator
(``torch``) or ``QuantLinear.forward`` (``linear``) instead. ``--stub-kernels`` first registers, for
each op, an implementation that returns the chosen one's stored result on the tiny case: the rows
are then hal's own Python alone, without the caches the real kernel evicts.

Usage: ``python benchmarks/call_overhead.py [--stub-kernels] [--profile door:OP|torch:OP|linear]``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections.abc import Callable
from typing import Any

import numpy as np

import hal_core
from hal_core.bench._overhead import _per_call_us, _torch_call, format_overhead, measure_overhead
from hal_core.ops import OPS, OpCall, OpImpl


def _tiny_args(op: str) -> dict[str, Any]:
    bench = OPS[op].bench
    assert bench is not None and bench.tiny is not None
    return bench.inputs(np.random.default_rng(0), {**bench.params, **bench.tiny})


def _linear_calls(backend: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(the implementation on a prepared request, ``QuantLinear.forward``) on the tiny quantized_gemm case."""
    import torch

    from hal_core.torch import QuantLinear, to_tensor

    args = _tiny_args("quantized_gemm")
    call = backend.ops.prepare("quantized_gemm", **args)
    impl, _ = backend.ops.choose(call)
    assert impl is not None
    layer = QuantLinear.from_weight(args["qweight"])
    x = to_tensor(args["x"])

    def direct(fn: Callable[[OpCall], Any] = impl.fn, c: OpCall = call) -> Any:
        return fn(OpCall(spec=c.spec, args=dict(c.args), backend=c.backend))

    def forward() -> Any:
        with torch.no_grad():
            return layer(x)

    return direct, forward


def _linear_row(backend: Any, batches: int = 15, inner: int = 100) -> str:
    direct, forward = _linear_calls(backend)
    direct(), forward()
    kernel, layer = [], []
    for _ in range(3):
        kernel.append(_per_call_us(direct, batches, inner))
        layer.append(_per_call_us(forward, batches, inner))
    return f"{'QuantLinear.forward':<22} {min(kernel):>6.1f} us {'+':>3}{min(layer) - min(kernel):.1f} us"


def _stub_kernels(backend: Any) -> None:
    """Make each op's tiny case answered by a stored result (an implementation above every other)."""
    for op, spec in OPS.items():
        if spec.bench is None or spec.bench.tiny is None:
            continue
        call = backend.ops.prepare(op, **_tiny_args(op))
        impl, _ = backend.ops.choose(call)
        if impl is not None:
            result = impl.fn(call)
            backend.ops.registry.register(OpImpl(op=op, fn=lambda c, r=result: r, name=f"stored {impl.name}",
                                                 priority=impl.priority + 1_000_000))


def _profile(target: str, backend: Any, calls: int = 3000) -> None:
    kind, _, op = target.partition(":")
    if kind == "linear":
        fn = _linear_calls(backend)[1]
    elif kind == "torch":
        found = _torch_call(op, _tiny_args(op))
        assert found is not None, "torch is not installed"
        fn = found
    else:
        spec, args = OPS[op], _tiny_args(op)
        front = getattr(backend.ops, op)
        keywords = {name: value for name, value in args.items() if spec.arg_named(name).keyword_only}
        positional = [args[a.name] for a in spec.args if not a.keyword_only and a.name in args]

        def fn() -> Any:
            return front(*positional, **keywords)
    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="backend name (default: the best available)")
    parser.add_argument("--profile", default=None, help="door:OP, torch:OP or linear: profile instead of timing")
    parser.add_argument("--stub-kernels", action="store_true", help="time hal's Python alone (see the docs)")
    args = parser.parse_args()
    backend = hal_core.get_backend(args.backend)
    if args.stub_kernels:
        _stub_kernels(backend)
    if args.profile:
        _profile(args.profile, backend)
        return
    print(format_overhead(measure_overhead(backend)))
    print(_linear_row(backend))


if __name__ == "__main__":
    main()
