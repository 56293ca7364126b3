"""``fused_moe``'s experts when each has few rows (decode): one native call runs them all, one expert per thread.

At decode a MoE call multiplies a few rows by each of ``top_k`` (or, batched, a few dozen) experts: small GEMVs
of about a megabyte each. Run one at a time (:func:`hal_cpu.ops.fused_moe.moe`'s loop), each GEMM and
activation is a Python call and a parallel job of its own, and the Python costs as much as the kernels.
``hal_cpu_expert_mlps`` (csrc/expert_mlps.cpp) runs each expert's w13 GEMM, gated activation and w2 GEMM on
one thread, the experts spread over the threads: one parallel job per MoE call, each expert's weights
streamed by one core.

The GEMM structs are not filled per call. Each expert's two structs (the kept launches of
:func:`~hal_cpu.ops.quantized_gemm.launch_for`, every field but the activations and the output) are copied
once into tables, numpy record arrays of one struct per expert: a table per rows-per-expert ``n``, in a set per
experts value, activation dtype, ``activations`` and thread count. Once every hit expert's structs are in the
tables, a call is one native entry, ``hal_cpu_moe_experts``: from the routed ids and weights it groups the
pairs by expert, gathers their rows, runs the experts as above and adds each token's rows; the Python around
it does not grow with the number of experts. The first call that meets an expert (at a row count) takes the
path that fills its structs: the pairs grouped in numpy and the structs gathered into one
``hal_cpu_expert_mlps`` call. An expert whose launch is built from arrays derived from the weight's values
(act-order W8A8's row order) is never kept, as for every GEMM (:mod:`hal_cpu.ops._launches`): its calls always
take that path, with structs built for the call alone.

The outputs are those of the loop: each kernel gives the same bits at every thread count, every expert's
structs are the loop's launches, and each token's rows are scaled (rounded to float32) and added from zero in
increasing expert order, as the loop adds them. Served: int4 experts with float activations (the in-register
W4A16 kernel) or int8 ones (W4A8's integer kernel), and int8 experts (W8A8); anything else (other kernels by
the rules, act-order W4A8) returns None and the caller runs its loop. The in-register W4A16 kernel redoes rows
holding non-finite values on another path (:func:`~hal_cpu.ops.quantized_gemm.gemm`), so a W4A16 result that
is not all finite is returned as None as well.

Allocated per call: the gathered rows ``[P, hidden]`` (``P = tokens * top_k``), float32 ``[P, 2 *
intermediate]``, ``[P, intermediate]`` and ``[P, hidden]`` for the experts' results, the hit experts' structs,
and the float32 output. Kept: per experts value at most :data:`MAX_SETS` sets of at most :data:`MAX_ROWS`
tables, two structs (about 250 bytes) per expert each, freed with the value.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hal_core.quant import ExpertWeights

from .. import _abi, _native
from ._kept import KeptPerValue
from ._native_args import DTYPE_CODES, fill_struct
from .gated_activation import activation_code
from .quantized_gemm import launch_for

__all__ = ["MAX_ROWS", "MAX_SETS", "combined", "kept_tables"]

#: The most rows an expert may have for the native call (the small-M GEMM kernels: beyond, one expert's
#: GEMM is worth a parallel job of its own). Also the most tables of a set (one per row count).
MAX_ROWS = 8

#: Table sets kept per experts value (one per activation dtype, ``activations`` and thread count seen).
MAX_SETS = 4

#: The kernel entry point of a kept launch -> hal_cpu_expert_mlps' kind.
_KINDS = {"hal_cpu_w4a16_gemv": _abi.EXPERT_W4A16, "hal_cpu_w8a8_gemm": _abi.EXPERT_W8A8,
          "hal_cpu_w4a8_gemm": _abi.EXPERT_W4A8}

_ACT = np.dtype(_abi.GatedActivationArgs)
_F32 = DTYPE_CODES[np.dtype(np.float32)]
_CAPACITY = MAX_ROWS  # tables per set, whatever MAX_ROWS is set to later


@dataclass
class _Table:
    """Every expert's w13 and w2 GEMM structs for one row count, as records, filled as experts are met."""

    ready: np.ndarray  # [E] bool: the expert's records hold kept launches (read by hal_cpu_moe_experts)
    up: np.ndarray | None = None
    down: np.ndarray | None = None
    hold: list[Any] = field(default_factory=list)  # the kept launches (their arrays), alive with the table


@dataclass
class _Set:
    """The tables of one experts value, activation dtype, ``activations`` and thread count, and the struct
    ``hal_cpu_moe_experts`` reads them through (per call: a copy with the call's arrays)."""

    tables: list[_Table]
    threads: int
    up: Any = field(default_factory=lambda: (ctypes.c_void_p * _CAPACITY)())  # table n - 1's records, or NULL
    down: Any = field(default_factory=lambda: (ctypes.c_void_p * _CAPACITY)())
    ready: Any = field(default_factory=lambda: (ctypes.c_void_p * _CAPACITY)())
    kind: int | None = None
    args: Any = None  # the MoeExpertsArgs template, once a table holds records


#: The table sets per experts value and signature (activation dtype, ``activations``, threads).
_SETS: KeptPerValue[_Set] = KeptPerValue(MAX_SETS)


def combined(native: _native.Native, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: ExpertWeights,
             activation: str, activations: str) -> np.ndarray | None:
    """The MoE layer's float32 ``[tokens, hidden]`` output for routed ``ids`` (int64) and ``weights`` (float32)
    ``[tokens, top_k]`` (each row's experts distinct), or None where the call cannot take the native path
    (module docs; also fewer experts hit than threads, or an expert with more than :data:`MAX_ROWS` rows)."""
    if (x.shape[0] == 0 or x.strides[1] != x.itemsize or ids.dtype != np.int64 or ids.strides[1] != 8
            or weights.dtype != np.float32 or weights.strides[1] != 4):
        return None
    kept = _set(native, experts, x.dtype, activations)
    out = np.empty((x.shape[0], experts.shape[1]), dtype=np.float32)
    if kept.args is not None:
        rc = _from_routing(native, kept, x, ids, weights, activation, out)
        if rc == _abi.DECLINED:
            return _filling(native, kept, x, ids, weights, experts, activation, activations)
        if rc:
            raise MemoryError("fused_moe: the CPU kernel could not allocate its workspace")
        return out
    return _filling(native, kept, x, ids, weights, experts, activation, activations)


def kept_tables(experts: ExpertWeights) -> int:
    """How many tables hold records for ``experts`` now, over its sets."""
    return sum(t.up is not None for kept in _SETS.found(experts) for t in kept.tables)


def _from_routing(native: _native.Native, kept: _Set, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                  activation: str, out: np.ndarray) -> int:
    """``hal_cpu_moe_experts`` over the set's tables: its return code (``out`` written on HAL_OK)."""
    args = _abi.MoeExpertsArgs.from_buffer_copy(kept.args)
    args.x, args.x_stride, args.x_itemsize = _native.pointer(x), x.strides[0] // x.itemsize, x.itemsize
    args.ids, args.ids_stride = _native.pointer(ids), ids.strides[0] // ids.itemsize
    args.weights, args.weights_stride = _native.pointer(weights), weights.strides[0] // weights.itemsize
    args.out, args.tokens, args.top_k = _native.pointer(out), ids.shape[0], ids.shape[1]
    args.activation, args.max_rows = activation_code(activation), min(MAX_ROWS, _CAPACITY)
    return int(native.lib.hal_cpu_moe_experts(ctypes.byref(args)))


def _filling(native: _native.Native, kept: _Set, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
             experts: ExpertWeights, activation: str, activations: str) -> np.ndarray | None:
    """The call with the pairs grouped in numpy and the hit experts' structs filled into the set's tables (or
    built for this call alone) on the way: one ``hal_cpu_expert_mlps`` call."""
    tokens, top_k = ids.shape
    hidden, inter = experts.shape[1], experts.shape[2]
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")  # the pairs grouped by expert, token order kept within each
    hit, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    if hit.size < native.threads or counts.max() > min(MAX_ROWS, _CAPACITY):
        return None
    found = _records(native, kept, experts, hit, counts, x.dtype, activations)
    if found is None:
        return None
    up, down, hold = found
    pair_tokens = order // top_k
    xs = x[pair_tokens]  # each expert's rows, one after another (a C-contiguous copy)
    pairs = xs.shape[0]
    h = np.empty((pairs, 2 * inter), dtype=np.float32)
    act = np.empty((pairs, inter), dtype=np.float32)
    y = np.empty((pairs, hidden), dtype=np.float32)
    up["x"] = xs.ctypes.data + starts * xs.strides[0]
    up["y"] = h.ctypes.data + starts * h.strides[0]
    down["x"] = act.ctypes.data + starts * act.strides[0]
    down["y"] = y.ctypes.data + starts * y.strides[0]
    acts = np.zeros(hit.size, dtype=_ACT)
    acts["gate"] = up["y"]
    acts["up"] = acts["gate"] + inter * h.itemsize  # the second half of each row
    acts["out"] = down["x"]
    acts["gate_stride"] = acts["up_stride"] = 2 * inter
    acts["out_stride"] = acts["intermediate_size"] = inter
    acts["num_tokens"] = acts["rows_per_task"] = counts
    acts["activation"], acts["dtype"], acts["threads"] = activation_code(activation), _F32, 1
    args = fill_struct(_abi.ExpertMlpsArgs, {"up": up.ctypes.data, "act": acts.ctypes.data,
                                            "down": down.ctypes.data, "jobs": int(hit.size), "kind": kept.kind,
                                            "threads": native.threads})
    if native.lib.hal_cpu_expert_mlps(ctypes.byref(args)):
        raise MemoryError("fused_moe: the CPU kernel could not allocate its workspace")
    del hold  # the launches built for this call alone, alive until it returned
    if kept.kind == _abi.EXPERT_W4A16 and not np.isfinite(y).all():
        return None
    y *= weights.reshape(-1)[order][:, None]
    # Each token's rows in increasing expert order, added one after another from zero, as the loop adds them.
    place = np.empty(pairs, dtype=np.intp)
    place[order] = np.arange(pairs)  # pair (token-major) -> its row of y
    slots = np.argsort(ids, axis=1) + top_k * np.arange(tokens)[:, None]  # each token's pairs, experts ascending
    by_token = y[place[slots]]  # [tokens, top_k, hidden]
    out = np.zeros((tokens, hidden), dtype=np.float32)
    for j in range(top_k):
        out += by_token[:, j]
    return out


def _records(native: _native.Native, kept: _Set, experts: ExpertWeights, hit: np.ndarray, counts: np.ndarray,
             dtype: np.dtype, activations: str) -> tuple[np.ndarray, np.ndarray, list[Any]] | None:
    """The hit experts' w13 and w2 records (copies, for this call to fill) and the launches built for this call
    alone; None where an expert has no launch, or the experts' kinds differ."""
    up = down = None
    hold: list[Any] = []
    with _SETS.lock:  # a record built for one call lives in its table only until it is copied out
        for n in np.unique(counts).tolist():
            table = kept.tables[n - 1]
            select = counts == n
            rows = hit[select]
            if not table.ready[rows].all() and not _fill(native, kept, n, experts, rows, dtype, activations, hold):
                return None
            assert table.up is not None and table.down is not None
            if up is None or down is None:
                up = np.empty(hit.size, dtype=table.up.dtype)
                down = np.empty(hit.size, dtype=table.down.dtype)
            up[select] = table.up[rows]
            down[select] = table.down[rows]
            for e in rows[~table.ready[rows]].tolist():
                table.up[e] = table.down[e] = 0
    if up is None or down is None:
        return None
    return up, down, hold


def _fill(native: _native.Native, kept: _Set, n: int, experts: ExpertWeights, rows: np.ndarray, dtype: np.dtype,
          activations: str, hold: list[Any]) -> bool:
    """Fill table ``n``'s records of the experts ``rows`` that are not ready: kept launches for good, others for
    this call (their launches appended to ``hold``); False where one has no launch or the kinds differ."""
    table = kept.tables[n - 1]
    x = np.empty((n, experts.shape[1]), dtype=dtype)
    act = np.empty((n, experts.shape[2]), dtype=np.float32)
    for e in rows[~table.ready[rows]].tolist():
        up = launch_for(native, x, experts.w13[e], activations)
        down = launch_for(native, act, experts.w2[e], activations)
        if up is None or down is None:
            return False
        kind = _KINDS.get(_name(up.fn))
        if kind is None or kind != _KINDS.get(_name(down.fn)) or (kept.kind is not None and kind != kept.kind):
            return False
        kept.kind = kind
        if table.up is None or table.down is None:
            _allocate(kept, n, experts, type(up.template), type(down.template))
        assert table.up is not None and table.down is not None
        table.up[e] = np.frombuffer(bytes(up.template), dtype=table.up.dtype)[0]
        table.down[e] = np.frombuffer(bytes(down.template), dtype=table.down.dtype)[0]
        if up.derived or down.derived:
            hold += (up, down)
        else:
            table.hold += (up, down)
            table.ready[e] = True
    return True


def _allocate(kept: _Set, n: int, experts: ExpertWeights, up: type[ctypes.Structure],
              down: type[ctypes.Structure]) -> None:
    """Table ``n``'s record arrays, published to ``hal_cpu_moe_experts`` through the set's struct."""
    table = kept.tables[n - 1]
    table.up = np.zeros(experts.num_experts, dtype=np.dtype(up))
    table.down = np.zeros(experts.num_experts, dtype=np.dtype(down))
    kept.up[n - 1], kept.down[n - 1] = table.up.ctypes.data, table.down.ctypes.data
    kept.ready[n - 1] = table.ready.ctypes.data
    kept.args = fill_struct(_abi.MoeExpertsArgs, {
        "x": None, "x_stride": 0, "ids": None, "ids_stride": 0, "weights": None, "weights_stride": 0, "out": None,
        "up": ctypes.addressof(kept.up), "down": ctypes.addressof(kept.down), "ready": ctypes.addressof(kept.ready),
        "tokens": 0, "top_k": 0, "num_experts": experts.num_experts, "hidden": experts.shape[1],
        "intermediate_size": experts.shape[2], "x_itemsize": 0, "max_rows": 0, "kind": kept.kind,
        "activation": 0, "threads": kept.threads})


def _set(native: _native.Native, experts: ExpertWeights, dtype: np.dtype, activations: str) -> _Set:
    """The table set of ``experts`` for this signature, kept while the value lives (oldest dropped first)."""
    threads = native.threads
    return _SETS.get(experts, (dtype, activations, threads), lambda: _Set(
        [_Table(np.zeros(experts.num_experts, dtype=bool)) for _ in range(_CAPACITY)], threads))


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", ""))
