"""``gated_activation`` on the host: ``act(gate) * up`` in one compiled pass per row (csrc/gated_activation.inl).

``gate`` and ``up`` may be strided views with contiguous rows (the halves of a fused gate-up projection).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner
from hal_core.ops.gated_activation import ACTIVATIONS, activate, activation_of

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, fill_struct, last_contiguous
from ._planned import struct_runner
from .rms_norm import rows_per_task

__all__ = ["activation_code", "gated", "gated_activation", "plan_gated_activation"]


def activation_code(activation: str) -> int:
    """The kernel's code of an activation (csrc/hal_cpu_kernels.h: HAL_ACT_SILU, HAL_ACT_GELU, HAL_ACT_GELU_TANH)."""
    return ACTIVATIONS.index(activation)


def gated_activation(call: OpCall) -> np.ndarray:
    """``act(gate) * up`` of a validated call."""
    return gated(np.asarray(call["gate"]), np.asarray(call["up"]), activation_of(call.args))


def gated(gate: np.ndarray, up: np.ndarray, activation: str = "silu", *, threads: int | None = None) -> np.ndarray:
    """``act(gate) * up`` of validated numpy inputs (``threads``: :func:`~hal_cpu.ops._rules.threads_for` if None)."""
    out = np.empty(gate.shape, dtype=gate.dtype)
    native = _native.try_load()
    if native is None:
        with np.errstate(invalid="ignore", over="ignore"):
            out[...] = activate(gate, activation) * up.astype(np.float64)
        return out
    gate, up = last_contiguous(gate), last_contiguous(up)
    args = fill_struct(_abi.GatedActivationArgs, _fields(gate, up, out, activation, threads, native.threads))
    native.lib.hal_cpu_gated_activation(ctypes.byref(args))
    return out


def plan_gated_activation(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`), or None where the kernel cannot take its arrays as
    they are."""
    native = _native.try_load()
    gate, up = call["gate"], call["up"]
    if native is None or last_contiguous(gate) is not gate or last_contiguous(up) is not up:
        return None
    fields = _fields(gate, up, None, activation_of(call.args), None, native.threads)
    return struct_runner(call, gated_activation, native.lib.hal_cpu_gated_activation, _abi.GatedActivationArgs,
                         fields, {"gate": "gate", "up": "up"}, out=("out", gate.shape, gate.dtype))


def _fields(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None, activation: str, threads: int | None,
            host_threads: int) -> dict[str, Any]:
    """The kernel's argument struct, by field (``out`` contiguous)."""
    num_tokens, inter = gate.shape
    if threads is None:
        threads = _rules.threads_for(3 * gate.size * gate.itemsize, host_threads)
    return dict(gate=gate, gate_stride=gate.strides[0] // gate.itemsize, up=up, up_stride=up.strides[0] // up.itemsize,
                out=out, out_stride=inter, num_tokens=num_tokens, intermediate_size=inter,
                rows_per_task=rows_per_task(num_tokens, int(threads)), activation=activation_code(activation),
                dtype=dtype_code(gate), threads=int(threads))
