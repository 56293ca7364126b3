"""``rms_norm`` on the host: one compiled pass per row block (csrc/rms_norm.inl), rows split across the pool.

``x`` and ``residual`` may be strided views whose rows are contiguous; ``out`` is a new contiguous array.
With a residual, the sum is written into ``residual`` (rounded to the dtype) by the same kernel, after every
check: nothing can fail once it starts.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, fill_struct, last_contiguous
from ._planned import struct_runner

__all__ = ["norm", "plan_rms_norm", "rms_norm"]


def rms_norm(call: OpCall) -> np.ndarray:
    """RMSNorm of ``x`` (plus ``residual``, written back) times ``weight_offset + weight``."""
    return norm(np.asarray(call["x"]), np.asarray(call["weight"]), float(call["epsilon"]),
                residual=call.args.get("residual"), weight_offset=float(call.args.get("weight_offset") or 0.0))


def rows_per_task(num_rows: int, threads: int) -> int:
    """Rows per parallel task: about :data:`~hal_cpu.ops._rules.TASKS_PER_THREAD` tasks per thread (1 at decode)."""
    return max(1, -(-num_rows // (threads * _rules.TASKS_PER_THREAD)))


def norm(x: np.ndarray, weight: np.ndarray, epsilon: float, *, residual: np.ndarray | None = None,
         weight_offset: float = 0.0, threads: int | None = None) -> np.ndarray:
    """The norm of validated numpy inputs (``threads`` defaults to :func:`~hal_cpu.ops._rules.threads_for`)."""
    out = np.empty(x.shape, dtype=x.dtype)
    native = _native.try_load()
    if native is None or (residual is not None and not _rows_in_place(residual)):
        _numpy_norm(x, weight, epsilon, residual, weight_offset, out)
        return out
    x, weight = last_contiguous(x), np.ascontiguousarray(weight)
    args = fill_struct(_abi.RmsNormArgs, _fields(x, weight, residual, out, epsilon, weight_offset, threads,
                                                 native.threads))
    native.lib.hal_cpu_rms_norm(ctypes.byref(args))
    return out


def plan_rms_norm(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`), or None where the kernel cannot take its arrays as
    they are."""
    native = _native.try_load()
    x, weight, residual = call["x"], call["weight"], call.args.get("residual")
    if native is None or last_contiguous(x) is not x or not weight.flags.c_contiguous \
            or (residual is not None and not _rows_in_place(residual)):
        return None
    fields = _fields(x, weight, residual, None, float(call["epsilon"]),
                     float(call.args.get("weight_offset") or 0.0), None, native.threads)
    return struct_runner(call, rms_norm, native.lib.hal_cpu_rms_norm, _abi.RmsNormArgs, fields,
                         {"x": "x", "weight": "weight", "residual": "residual"}, out=("out", x.shape, x.dtype))


def _fields(x: np.ndarray, weight: np.ndarray, residual: np.ndarray | None, out: np.ndarray | None,
            epsilon: float, weight_offset: float, threads: int | None, host_threads: int) -> dict[str, Any]:
    """The kernel's argument struct, by field (``out`` contiguous)."""
    num_tokens, hidden = x.shape
    if threads is None:
        threads = _rules.threads_for((4 if residual is not None else 2) * x.size * x.itemsize, host_threads)
    return dict(x=x, x_stride=x.strides[0] // x.itemsize, weight=weight, residual=residual,
                residual_stride=residual.strides[0] // x.itemsize if residual is not None else 0, out=out,
                out_stride=hidden, num_tokens=num_tokens, hidden_size=hidden,
                rows_per_task=rows_per_task(num_tokens, int(threads)), epsilon=epsilon, weight_offset=weight_offset,
                dtype=dtype_code(x), threads=int(threads))


def _rows_in_place(array: np.ndarray) -> bool:
    """Whether the kernel can write ``array`` where it is (contiguous rows, whole-element strides)."""
    item = array.itemsize
    return (array.shape[-1] <= 1 or array.strides[-1] == item) and all(s % item == 0 for s in array.strides)


def _numpy_norm(x: np.ndarray, weight: np.ndarray, epsilon: float, residual: np.ndarray | None,
                weight_offset: float, out: np.ndarray) -> None:
    """The fallback (no compiled kernels): the same float32 math in numpy."""
    h = x.astype(np.float32)
    if residual is not None:
        residual[...] = h + residual.astype(np.float32)
        h = residual.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scale = np.float32(1.0) / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + np.float32(epsilon))
        out[...] = h * scale * (weight.astype(np.float32) + np.float32(weight_offset))
