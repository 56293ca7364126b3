"""Launches of the compiled GEMM kernels, prepared once per weight and call signature and kept with the weight.

A GEMM call's argument struct has about sixteen fields. Filling it costs about 20 µs of Python on a
2-core VM, twenty times a decode-sized kernel: the rules pick tiles, parts and threads, each array's
address is read through numpy, and ctypes converts every value. A :class:`Launch` is that work done
once: the kernel function, its argument struct with every field filled but the activations and the
output, and the arrays the struct points at. A call copies the struct (so concurrent calls never
share one), writes those two addresses and runs the kernel.

Launches are kept per weight and per signature:

- the weight is a :class:`~hal_core.quant.QuantizedWeight`, by identity and weakly, so its launches are
  freed with it;
- the signature is the rows, the activations' dtype and row stride, the kernel, the thread count and
  whether the bf16 dot product serves that dtype.

At most :data:`MAX_LAUNCHES_PER_WEIGHT` are kept per weight, the oldest dropped first. Only launches
that point at the weight's own arrays are kept. A weight's arrays are read in place at each call, so
in-place changes to them (a ``load_state_dict`` into a layer's buffers) reach the next call. A launch
that needs arrays derived from the weight's values (act-order's row order for W8A8, scales converted
to float32) is built for its call alone, as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hal_core.quant import QuantizedWeight

from .. import _native
from ._kept import KeptPerValue
from ._native_args import fill_struct

__all__ = ["MAX_LAUNCHES_PER_WEIGHT", "Launch", "kept", "launch_count", "weight_arrays"]

#: Signatures kept per weight: a decode step sees one or two row counts per layer, a server a few batch sizes.
MAX_LAUNCHES_PER_WEIGHT = 8


@dataclass(frozen=True, eq=False)
class Launch:
    """One compiled GEMM kernel with its argument struct filled for one weight and call signature.

    ``template`` holds every field but ``x`` and ``y`` (null there); ``keep`` holds the arrays its pointers
    address, alive as long as the launch; ``derived`` says whether one of them was computed from the
    weight's values (then the launch is never kept: an in-place change to the weight would not reach it).
    """

    fn: Callable[[Any], int]
    template: ctypes.Structure
    keep: tuple[Any, ...]
    derived: bool

    @classmethod
    def build(cls, fn: Callable[[Any], int], struct: type[ctypes.Structure], fields: dict[str, Any],
              keep: tuple[Any, ...], derived: bool) -> Launch:
        """A launch of ``fn`` on ``struct`` filled from ``fields`` (:func:`fill_struct`), with ``x`` and ``y`` null."""
        return cls(fn=fn, template=fill_struct(struct, {**fields, "x": None, "y": None}), keep=keep,
                   derived=derived)

    def run(self, x: np.ndarray, y: np.ndarray) -> int:
        """The kernel's return code for activations ``x`` and output ``y`` of this launch's signature."""
        args = type(self.template).from_buffer_copy(self.template)
        args.x = _native.pointer(x)
        args.y = _native.pointer(y)
        return self.fn(ctypes.byref(args))


def weight_arrays(qweight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None,
                                                       bool]:
    """``(codes, scales, zeros, g_idx, derived)`` as the kernels read them; ``derived``: one is a converted copy."""
    qw, scales = np.asarray(qweight.qweight), np.asarray(qweight.scales)
    zeros = None if qweight.zeros is None else np.asarray(qweight.zeros)
    g_idx = None if qweight.g_idx is None else np.ascontiguousarray(qweight.g_idx, dtype=np.int32)
    derived = g_idx is not None and g_idx is not qweight.g_idx
    if not (scales.dtype in (np.float32, np.float16) or scales.dtype.name == "bfloat16"):
        scales, derived = scales.astype(np.float32), True
    return qw, scales, zeros, g_idx, derived


#: Launches per weight and signature; only those over the weight's own arrays are kept.
_KEPT: KeptPerValue[Launch] = KeptPerValue(MAX_LAUNCHES_PER_WEIGHT)


def kept(qweight: QuantizedWeight, signature: tuple[Any, ...], build: Callable[[], Launch]) -> Launch:
    """The launch kept for ``qweight`` and ``signature``, else ``build()`` (kept unless it is ``derived``)."""
    return _KEPT.get(qweight, signature, build, keep=lambda launch: not launch.derived)


def launch_count(qweight: QuantizedWeight | None = None) -> int:
    """How many launches are kept for ``qweight`` now (None: for every weight alive)."""
    return _KEPT.count() if qweight is None else len(_KEPT.found(qweight))
