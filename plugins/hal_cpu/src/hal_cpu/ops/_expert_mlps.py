"""``fused_moe``'s experts when each has few rows (decode): one native call runs them all, one expert per thread.

At decode a MoE call multiplies a few rows by each of ``top_k`` (or, batched, a few dozen) experts: small GEMVs
of about a megabyte each. Run one at a time (:func:`hal_cpu.ops.fused_moe.moe`'s loop), each GEMM and
activation is a Python call and a parallel job of its own, and the Python costs as much as the kernels.
``hal_cpu_expert_mlps`` (csrc/expert_mlps.cpp) takes every expert's three calls prepared here (the kept GEMM
launches of :func:`~hal_cpu.ops.quantized_gemm.launch_for` with their rows and buffers, and the gated
activation's struct) and runs each expert on one thread, the experts spread over the threads: one parallel
job per MoE call, each expert's weights streamed by one core.

The outputs are those of the loop: each kernel gives the same bits at every thread count, and the caller adds
the experts' rows in the same order. Served: int4 experts with float activations (the in-register W4A16
kernel) or int8 ones (W4A8's integer kernel), and int8 experts (W8A8); anything else (other kernels by the
rules, act-order W4A8) returns None and the caller runs its loop. The in-register W4A16 kernel redoes rows
holding non-finite values on another path (:func:`~hal_cpu.ops.quantized_gemm.gemm`), so a W4A16 result
that is not all finite is returned as None as well.

Allocated per call, besides what the loop allocates (each expert's rows, projection, activation and output):
three ctypes arrays of the experts' argument structs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from hal_core.quant import ExpertWeights

from .. import _abi, _native
from ._native_args import dtype_code, fill_struct
from .gated_activation import activation_code
from .quantized_gemm import launch_for

__all__ = ["MAX_ROWS", "outputs"]

#: The most rows an expert may have for the native call (the small-M GEMM kernels: beyond, one expert's
#: GEMM is worth a parallel job of its own).
MAX_ROWS = 8

#: The kernel entry point of a kept launch -> hal_cpu_expert_mlps' kind.
_KINDS = {"hal_cpu_w4a16_gemv": _abi.EXPERT_W4A16, "hal_cpu_w8a8_gemm": _abi.EXPERT_W8A8,
          "hal_cpu_w4a8_gemm": _abi.EXPERT_W4A8}


def outputs(native: _native.Native, rows: Sequence[np.ndarray], experts: ExpertWeights, ids: Sequence[int],
            activation: str, activations: str) -> list[np.ndarray] | None:
    """``[w2_e(act(w13_e(x_e)))]`` as float32 ``[n_e, hidden]`` for each expert ``e = ids[j]`` and its rows
    ``rows[j]`` (C-contiguous ``[n_e, hidden]``); None where a call cannot take the native path (see the module
    docs)."""
    inter, hidden = experts.shape[2], experts.shape[1]
    jobs = len(ids)
    kind = None
    up_structs: list[Any] = []
    down_structs: list[Any] = []
    acts = (_abi.GatedActivationArgs * jobs)()
    code = activation_code(activation)
    results = []
    held: list[Any] = []  # every job's launches (a derived one owns its arrays) and buffers, alive through the call
    for j, (x, e) in enumerate(zip(rows, ids, strict=True)):
        n = x.shape[0]
        h = np.empty((n, 2 * inter), dtype=np.float32)
        act = np.empty((n, inter), dtype=np.float32)
        y = np.empty((n, hidden), dtype=np.float32)
        up = launch_for(native, x, experts.w13[e], activations)
        down = launch_for(native, act, experts.w2[e], activations)
        if up is None or down is None:
            return None
        up_kind, down_kind = _KINDS.get(_name(up.fn)), _KINDS.get(_name(down.fn))
        if up_kind is None or up_kind != down_kind or (kind is not None and up_kind != kind):
            return None
        kind = up_kind
        up_structs.append(_filled(up.template, x, h))
        down_structs.append(_filled(down.template, act, y))
        fill = acts[j]
        fill.gate, fill.gate_stride = _native.pointer(h), 2 * inter
        fill.up, fill.up_stride = fill.gate + h.itemsize * inter, 2 * inter  # the second half of each row
        fill.out, fill.out_stride = _native.pointer(act), inter
        fill.num_tokens, fill.intermediate_size, fill.rows_per_task = n, inter, n
        fill.activation, fill.dtype, fill.threads = code, dtype_code(h), 1
        results.append(y)
        held += (up, down, h, act)
    if kind is None:
        return None
    struct = type(up_structs[0])
    args = fill_struct(_abi.ExpertMlpsArgs, {
        "up": ctypes.addressof(ups := (struct * jobs)(*up_structs)),
        "act": ctypes.addressof(acts),
        "down": ctypes.addressof(downs := (struct * jobs)(*down_structs)),
        "jobs": jobs, "kind": kind, "threads": native.threads})
    if native.lib.hal_cpu_expert_mlps(ctypes.byref(args)):
        raise MemoryError("fused_moe: the CPU kernel could not allocate its workspace")
    del ups, downs, held  # alive until the call returned
    if kind == _abi.EXPERT_W4A16 and not all(np.isfinite(y).all() for y in results):
        return None
    return results


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", ""))


def _filled(template: Any, x: np.ndarray, y: np.ndarray) -> Any:
    """A copy of a launch's struct with its activations and output addresses."""
    args = type(template).from_buffer_copy(template)
    args.x = _native.pointer(x)
    args.y = _native.pointer(y)
    return args
