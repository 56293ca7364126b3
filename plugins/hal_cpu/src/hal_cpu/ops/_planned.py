"""Runners of the compiled kernels for a repeated call signature (:attr:`hal_core.ops.OpImpl.plan`).

An op's Python wrapper costs more than its kernel on a decode-sized call: it checks layouts, picks threads,
reads each array's address and converts a dozen struct fields, all of which a call signature fixes (shapes,
strides, dtypes, scalars, the bound arrays). :func:`struct_runner` does that once: it fills the kernel's
argument struct from the signature's first call, leaving null the pointers of the arrays that change per
call (those not bound, :attr:`~hal_core.ops.OpCall.fixed`) and of the output. A call then copies the
struct (concurrent calls never share one), writes those addresses, allocates the output and runs the kernel.

A plan is made only where the wrapper would pass the call's own arrays (no contiguous copy, no dtype
conversion: either would make a per-call array the template cannot point at), and it holds for the thread
count it was made with: after :func:`hal_cpu.set_threads` the runner calls the op's function instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner

from .. import _native, _threads
from ._native_args import fill_struct

__all__ = ["struct_runner"]


def struct_runner(call: OpCall, fn: Callable[[OpCall], Any], kernel: Callable[[Any], Any],
                  struct: type[ctypes.Structure], fields: Mapping[str, Any], arrays: Mapping[str, str],
                  out: tuple[str, tuple[int, ...], np.dtype] | None = None, enomem: str | None = None) -> Runner:
    """A runner of ``kernel`` for the calls of ``call``'s signature.

    ``fields`` fill ``struct`` for ``call`` (:func:`~hal_cpu.ops._native_args.fill_struct`'s values, arrays
    as arrays); ``arrays`` maps each pointer field that addresses one of the call's arguments to that
    argument's name (read per call unless it is bound); ``out`` names the output's pointer field, shape and
    dtype (None: the kernel writes its arguments in place and the runner returns None). ``fn`` serves a call
    the plan does not cover (another thread count). ``enomem``: the message of the ``MemoryError`` raised when
    the kernel returns non-zero (it could not allocate its workspace); None for a kernel that allocates nothing.
    """
    varying = tuple((field, name) for field, name in arrays.items() if name not in call.fixed)
    blank = {field: None for field, _ in varying}
    if out is not None:
        blank[out[0]] = None
    template = fill_struct(struct, {**fields, **blank})
    threads = _threads.current()
    copy, pointer, byref, current = struct.from_buffer_copy, _native.pointer, ctypes.byref, _threads.current
    kept = call.signature_only()

    def unplanned(args: Mapping[str, Any]) -> Any:
        return fn(kept.with_args(args))

    out_field, shape, dtype = out if out is not None else ("", (), None)

    def run(args: Mapping[str, Any]) -> Any:
        if current() != threads:
            return unplanned(args)
        filled = copy(template)
        for field, name in varying:
            setattr(filled, field, pointer(args.get(name)))
        if dtype is None:
            kernel(byref(filled))
            return None
        result = np.empty(shape, dtype)
        setattr(filled, out_field, pointer(result))
        if kernel(byref(filled)) and enomem is not None:
            raise MemoryError(enomem)
        return result

    return run
