"""``quantized_gemm`` on the host: compiled kernels that read the packed weight, never a float copy of it.

- W4A16, ``'registers'`` kernel (small M): int4 codes are unpacked inside the
  inner loop, zero points and scales applied once per group; it streams the
  packed bytes once per call (csrc/w4a16.inl, ``w4a16_gemv``). With fp16/bf16
  activations on a CPU with AVX512_BF16 the codes become bf16 pairs and the
  activations exact bf16 parts, multiplied by ``vdpbf16ps`` (csrc/w4_bf16.inl).
- W4A16, ``'blocked'`` kernel (large M, act-order, or groups that split packed
  words): a cache-blocked float32 GEMM whose B panels are dequantised from
  int4 into a 256 KiB buffer per task (L2-sized), with packed activations and
  a register-tiled micro-kernel (csrc/w4_blocked.inl, ``w4a16_blocked``).
- W4A16, ``'tiles'`` kernel (a candidate for ``hal tune``): columns are
  dequantised into one bounded float32 tile ``[K, columns]`` at a time
  (:data:`~hal_cpu.ops._rules.DEQUANT_TILE_BYTES`) and multiplied with numpy's
  BLAS, for hosts whose BLAS outruns the blocked kernel; freed when the call returns.
- W8A8: activations are quantised per token inside the kernel, bit for bit as
  :func:`~hal_core.quant.quantize_activations`; integer dot products are exact
  per group, then scaled by the group scales and the token scale. On CPUs with
  AVX512_VNNI the products are int8 x uint8 byte dot products summed in int32
  (codes read in place over wide column tiles for M <= 4; above, each task
  packs its block of up to 32 64-column panels one group of K at a time from
  contiguous code-row runs and runs 6 x 64 register tiles over them;
  csrc/w8a8_vnni.inl); on the avx2 and avx512 variants for M >= 2 pairs of
  code rows widened to int16 and multiplied by activation pairs in
  ``vpmaddwd`` (6 x 16 register tiles, csrc/w8a8_avx2.inl), for one row exact
  float sums swept across each task's columns (``w8_avx2_sweep1``); elsewhere exact
  float sums. All give the same bits for a row. A row of ``x`` holding NaN
  or Inf gives a row of NaN.

- W4A8 (int4 weights, ``activations='int8'``): :mod:`hal_cpu.ops._w4a8`, the
  W8A8 quantisation with int4 codes summed exactly in int32 per group
  (``vpdpbusd`` on AVX512_VNNI), the same bits on every variant.

A call of many rows runs as row blocks (:func:`gemm_in_blocks`, :func:`hal_cpu.ops._rules.gemm_row_block`:
256 rows, 64 for W4A16 on bf16 dot products), each block's float32 result rounded into the output before the next
block runs: the per-call allocations below are then per block, M its rows.

What each kernel allocates per call (all freed when it returns; never a float
copy of the weight):

- every kernel: the float32 result ``[M, N]``, then for fp16/bf16 ``x`` the
  result in its dtype (:func:`hal_cpu.ops._common.narrow`: the compiled
  ``hal_cpu_from_float32`` rounds a large one in parallel, numpy's bits); in
  row blocks the output in its dtype and one block's float32 result;
- ``'registers'`` W4A16: ``x`` in float32 and its group sums (``M * K + M * K/G``
  floats), then ``M * K`` pre-scaled floats (float32 loop) or ``M * K/2``
  (bf16 activations) / ``M * K`` (fp16: high and low parts) pair words
  (AVX512_BF16 loop); the sweep's partial sums, ``M x tile`` floats per
  running task (M <= 2, and the float32 loop at any M, where the tile keeps
  them within :data:`~hal_cpu.ops._rules.SWEEP_PARTIAL_BYTES`) and, with K in
  parts, ``(parts - 1) * M * N`` floats;
- ``'blocked'`` W4A16: the packed activations (``ceil(M/8) * 8 * K`` floats plus
  ``ceil(M/8) * K`` to convert through) and one 256 KiB panel per running task;
- ``'tiles'`` W4A16: one dequantised tile ``[K, columns]`` of at most
  :data:`~hal_cpu.ops._rules.DEQUANT_TILE_BYTES`, ``[M, columns]`` floats, and
  ``x`` in float32 unless it already is;
- W8A8 (``avx512vnni``): the int8 activation panel ``M * Kp`` bytes (``Kp`` at
  most ``K + 3`` per segment), ``M * segments + M`` floats; M <= 4: 32 KiB of
  int32 accumulators per task on the stack (and ``(parts - 1) * M * N`` floats
  with K in parts); M > 4: one packing workspace per running thread, at most
  320 KiB (weight-derived codes of one group of K for the task's columns);
- W8A8 (other variants): ``M * K`` floats (quantised activations) and
  ``M * segments`` floats; on avx2/avx512 with M >= 2 also ``M * Kw`` int32
  activation pairs (``Kw <= K / 2 + segments``) and ``M * segments`` int32;
- W4A8: see :mod:`hal_cpu.ops._w4a8`.

No weight-derived array outlives a call. What a call of a weight and signature prepares (the kernel's
argument struct, its tiles and threads) is kept with the weight for the next such call
(:mod:`hal_cpu.ops._launches`): a decode-sized call then costs a struct copy and two addresses in Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner
from hal_core.ops.quantized_gemm import int8_activations
from hal_core.quant import QuantizedWeight

from .. import _abi, _native, _threads
from . import _fallback_gemm, _knobs, _launches, _rules, _tiles, _w4a8
from ._common import narrow
from ._native_args import dtype_code

__all__ = ["W8A8_ACC_WORDS", "W8A8_SMALL_M_MAX", "gemm", "gemm_in_blocks", "half_dot", "launch_for",
           "plan_quantized_gemm", "quantized_gemm", "row_block", "w8a8_column_tile"]

#: The int32 accumulators of one small-M W8A8 task (csrc/w8a8_vnni.inl, ``kVnniAccWords``): M x columns at most.
W8A8_ACC_WORDS = 8192
#: The largest M of the small-M W8A8 kernel (``kVnniGemvRows``).
W8A8_SMALL_M_MAX = 4


def quantized_gemm(call: OpCall) -> np.ndarray:
    """The registered implementation for int4 (W4A16, W4A8) and int8 (W8A8) weights; W4A16's kernel is a knob.

    A call of many rows runs in row blocks (:func:`gemm_in_blocks`); a kernel chosen by ``hal tune`` or forced
    while tuning runs every block, otherwise each block gets the rules' kernel for its rows.
    """
    qweight, x = call["qweight"], np.asarray(call["x"])
    dtype = call.spec.output_dtype(call.args)
    if int8_activations(call.args):
        return gemm_in_blocks(x, qweight, dtype, activations="int8")
    chosen = _knobs.GEMM_KERNEL.chosen(call)  # None: the rules' choice, made for each block's rows
    kernel = None if chosen is None else str(chosen)
    if kernel == "registers" and qweight.bits == 4 and (qweight.g_idx is not None or qweight.group_size % 8):
        kernel = "blocked"  # a stored choice the in-register kernel cannot serve for this weight
    return gemm_in_blocks(x, qweight, dtype, kernel=kernel)


def row_block(native: _native.Native | None, x: np.ndarray, qweight: QuantizedWeight, activations: str = "float",
              kernel: str | None = None) -> int:
    """Rows per block of a large call of ``x`` and ``qweight`` (:func:`hal_cpu.ops._rules.gemm_row_block`; 0 for
    none)."""
    int8 = qweight.bits == 8 or activations == "int8"
    half_registers = (native is not None and kernel in (None, "registers") and half_dot(native, x.dtype)
                      and qweight.g_idx is None and qweight.group_size % 8 == 0)
    return _rules.gemm_row_block(int8, half_registers, x.dtype == np.float32)


def gemm_in_blocks(x: np.ndarray, qweight: QuantizedWeight, dtype: Any, *, kernel: str | None = None,
                   activations: str = "float") -> np.ndarray:
    """:func:`gemm`'s result in ``dtype`` (the op's output dtype); a call of at least twice
    :func:`row_block` rows runs as row blocks (:func:`hal_cpu.ops._rules.row_spans`), each block's float32
    result rounded into the output before the next block runs, so the float32 result held is one block's."""
    native = _native.try_load()
    spans = _rules.row_spans(x.shape[0], row_block(native, x, qweight, activations, kernel))
    if len(spans) == 1:
        return narrow(gemm(x, qweight, kernel=kernel, activations=activations), dtype)
    out = np.empty((x.shape[0], qweight.shape[1]), dtype)
    for start, stop in spans:
        narrow(gemm(x[start:stop], qweight, kernel=kernel, activations=activations), dtype, out=out[start:stop])
    return out


def plan_quantized_gemm(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`): the weight's kept launches run on each call's
    activations (one per row block size, :func:`gemm_in_blocks`). None where a call runs something else: an
    unbound weight, a launch derived from the weight's values, the tiles or blocked kernels, a tuned kernel other
    than the rule's, activations the kernel cannot address in place."""
    native = _native.try_load()
    x, qweight = call["x"], call["qweight"]
    if native is None or "qweight" not in call.fixed or 0 in x.shape or 0 in qweight.shape \
            or x.strides[-1] != x.itemsize or x.strides[0] % x.itemsize:
        return None
    w4a8 = int8_activations(call.args)
    acts = "int8" if w4a8 else "float"
    chosen = None if w4a8 else _knobs.GEMM_KERNEL.chosen(call)
    blocks: list[tuple[int, int, _launches.Launch, bool]] = []
    for start, stop in _rules.row_spans(x.shape[0], row_block(native, x, qweight, acts,
                                                              None if chosen is None else str(chosen))):
        rows = x[start:stop]
        rule = _rules.gemm_kernel(stop - start, qweight.bits, qweight.group_size, qweight.g_idx is not None,
                                  native.isa, half_dot(native, x.dtype))
        launch = launch_for(native, rows, qweight, acts)
        if launch is None or launch.derived or chosen not in (None, rule):
            return None
        check_finite = not w4a8 and qweight.bits == 4 and rule == "registers"
        blocks.append((start, stop, launch, check_finite))
    threads, current = native.threads, _threads.current
    shape, dtype = (x.shape[0], qweight.shape[1]), call.spec.output_dtype(call.args)
    kept = call.signature_only()
    if len(blocks) == 1:
        launch, check_finite = blocks[0][2], blocks[0][3]

        def run(args: Mapping[str, Any]) -> np.ndarray:
            if current() != threads:
                return quantized_gemm(kept.with_args(args))
            x = args["x"]
            y = np.empty(shape, dtype=np.float32)
            if launch.run(x, y):
                raise MemoryError("quantized_gemm: the CPU kernel could not allocate its workspace")
            if check_finite and not np.isfinite(y).all():
                _redo_non_finite_rows(native, x, qweight, y)
            return narrow(y, dtype)

        return run
    widest = max(stop - start for start, stop, _, _ in blocks)
    in_place = np.dtype(dtype) == np.float32

    def run_blocks(args: Mapping[str, Any]) -> np.ndarray:
        if current() != threads:
            return quantized_gemm(kept.with_args(args))
        x = args["x"]
        out = np.empty(shape, dtype)
        scratch = None if in_place else np.empty((widest, shape[1]), dtype=np.float32)
        for start, stop, launch, check_finite in blocks:
            rows = x[start:stop]
            y = out[start:stop] if scratch is None else scratch[:stop - start]
            if launch.run(rows, y):
                raise MemoryError("quantized_gemm: the CPU kernel could not allocate its workspace")
            if check_finite and not np.isfinite(y).all():
                _redo_non_finite_rows(native, rows, qweight, y)
            if scratch is not None:
                narrow(y, dtype, out=out[start:stop])
        return out

    return run_blocks


def gemm(
    x: np.ndarray,
    qweight: QuantizedWeight,
    *,
    kernel: str | None = None,
    n_tile: int | None = None,
    k_parts: int | None = None,
    tile_bytes: int | None = None,
    threads: int | None = None,
    activations: str = "float",
) -> np.ndarray:
    """``x [M, K]`` times the quantised weight, as float32 ``[M, N]`` (validated numpy inputs).

    ``activations='int8'`` with an int4 weight runs W4A8 (:mod:`hal_cpu.ops._w4a8`; ``kernel``, ``n_tile``,
    ``k_parts`` and ``tile_bytes`` do not apply); int8 weights run W8A8 whatever it says.

    ``kernel`` (``'registers'``, ``'blocked'`` or ``'tiles'``), ``n_tile`` (columns per task
    of the in-register kernels), ``k_parts`` (parts of K of the small-M in-register
    and W8A8 kernels, summed in order: the result depends on it), ``tile_bytes``
    (the dequantised tile's size) and ``threads`` default to the rules in
    :mod:`hal_cpu.ops._rules`.
    """
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0 or n == 0 or k == 0:
        return np.zeros((m, n), dtype=np.float32)
    w4a8 = qweight.bits == 4 and activations == "int8"
    native = _native.try_load()
    if native is None:
        return _fallback_gemm.gemm(x, qweight, int8_activations=w4a8)
    if x.strides[-1] != x.itemsize or x.strides[0] % x.itemsize:
        x = np.ascontiguousarray(x)
    if w4a8:
        return _w4a8.gemm(native, x, qweight, threads)
    half = half_dot(native, x.dtype)
    if kernel is None:
        kernel = _rules.gemm_kernel(m, qweight.bits, qweight.group_size, qweight.g_idx is not None, native.isa,
                                    half)
    if kernel not in ("registers", "blocked", "tiles"):
        raise ValueError(f"argument 'kernel': expected 'registers', 'blocked' or 'tiles', got {kernel!r}")
    y = np.empty((m, n), dtype=np.float32)
    if kernel == "tiles" and qweight.bits == 4:
        qw, scales, zeros, g_idx, _ = _launches.weight_arrays(qweight)
        threads = _rules.threads_for(qweight.nbytes + x.nbytes, native.threads) if threads is None else threads
        rc = _tiles.tiles(native, x, x.strides[0] // x.itemsize, qweight, qw, scales, zeros, g_idx, y, tile_bytes,
                          threads)
    else:
        if n_tile is None and k_parts is None and threads is None:
            signature = (m, x.dtype, x.strides[0], kernel, native.threads, half)
            launch = _launches.kept(qweight, signature, lambda: _launch(native, x, qweight, kernel, half))
        else:
            launch = _launch(native, x, qweight, kernel, half, n_tile, k_parts, threads)
        rc = launch.run(x, y)
    if rc:
        raise MemoryError("quantized_gemm: the CPU kernel could not allocate its workspace")
    if kernel == "registers" and qweight.bits == 4 and not np.isfinite(y).all():
        _redo_non_finite_rows(native, x, qweight, y)
    return y


def launch_for(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight,
               activations: str = "float") -> _launches.Launch | None:
    """The launch :func:`gemm` runs for ``x`` (C-contiguous, at least one row) and ``qweight`` with the rules'
    settings, kept with the weight as there; None where it runs no launch (the tiles and blocked kernels, W4A8's
    tiles path)."""
    m = x.shape[0]
    if qweight.bits == 4 and activations == "int8":
        if not _w4a8.integer_kernel(qweight):
            return None
        w4a8: tuple[Any, ...] = ("w4a8", m, x.dtype, x.strides[0], native.threads)
        return _launches.kept(qweight, w4a8, lambda: _w4a8.launch(native, x, qweight, None))
    half = half_dot(native, x.dtype)
    kernel = _rules.gemm_kernel(m, qweight.bits, qweight.group_size, qweight.g_idx is not None, native.isa, half)
    if qweight.bits == 4 and kernel != "registers":
        return None
    signature = (m, x.dtype, x.strides[0], kernel, native.threads, half)
    return _launches.kept(qweight, signature, lambda: _launch(native, x, qweight, kernel, half))


def _launch(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight, kernel: str, half: bool,
            n_tile: int | None = None, k_parts: int | None = None, threads: int | None = None) -> _launches.Launch:
    """The W8A8 or in-register / blocked W4A16 launch for ``x``'s signature (rows, dtype, row stride)."""
    m, k = x.shape
    n = qweight.shape[1]
    qw, scales, zeros, g_idx, derived = _launches.weight_arrays(qweight)
    if threads is None:
        threads = _rules.threads_for(qweight.nbytes + x.nbytes, native.threads)
    if k_parts is None:
        k_parts = _rules.gemv_k_parts(n, qweight.bits, m)
    if n_tile is None:
        if qweight.bits == 8:
            n_tile = w8a8_column_tile(n, threads, m, k_parts)
        elif half:
            n_tile = _rules.gemv_column_tile(n, threads, m, k_parts)
        else:  # the float32 loop sweeps at every M
            n_tile = _rules.sweep_column_tile(n, threads, m, k_parts)
    # The fields every GEMM struct shares: activations (filled per call), weight, output (per call).
    common = {"x_stride": x.strides[0] // x.itemsize, "m": m, "k": k, "n": n, "qweight": qw, "scales": scales,
              "zeros": zeros, "x_dtype": dtype_code(x), "s_dtype": dtype_code(scales),
              "default_zero": qweight.default_zero, "threads": int(threads)}
    lib = native.lib
    if qweight.bits == 8:
        perm, starts, groups = _group_runs(k, qweight.group_size, g_idx)
        return _launches.Launch.build(
            lib.hal_cpu_w8a8_gemm, _abi.W8a8GemmArgs,
            dict(**common, perm=perm, group_starts=starts, group_of_run=groups, runs=groups.size, n_tile=n_tile,
                 k_parts=k_parts),
            keep=(qw, scales, zeros, perm, starts, groups), derived=derived or perm is not None)
    if kernel == "registers":
        if g_idx is not None or qweight.group_size % 8:
            raise ValueError("quantized_gemm: kernel='registers' needs group_size % 8 == 0 and no act-order")
        return _launches.Launch.build(lib.hal_cpu_w4a16_gemv, _abi.W4a16GemvArgs,
                                      dict(**common, group_size=qweight.group_size, n_tile=n_tile, k_parts=k_parts),
                                      keep=(qw, scales, zeros), derived=derived)
    return _launches.Launch.build(lib.hal_cpu_w4a16_blocked, _abi.W4a16BlockedArgs,
                                  dict(**common, g_idx=g_idx, group_size=qweight.group_size),
                                  keep=(qw, scales, zeros, g_idx), derived=derived)


def half_dot(native: _native.Native, dtype: np.dtype) -> bool:
    """Whether the in-register W4A16 kernel multiplies activations of ``dtype`` with bf16 dot products here."""
    return dtype.itemsize == 2 and bool(native.lib.hal_cpu_w4a16_half_dot())


def _redo_non_finite_rows(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight, y: np.ndarray) -> None:
    """Rows of ``x`` holding NaN/inf again through the blocked kernel, so they follow IEEE products as the reference.

    The in-register kernel factors the zero point out of each group's sum, which turns ``inf * 0``
    patterns into NaN where the float64 reference gives an infinity. Only reached when a result is not
    finite (checked on the output, so the finite hot path pays one pass over ``y``).
    """
    bad = np.flatnonzero(~np.isfinite(x.astype(np.float32, copy=False)).all(axis=1))
    if bad.size == 0:
        return  # an overflow of finite inputs: the kernel's result stands
    rows = np.ascontiguousarray(x[bad])
    redo = np.empty((bad.size, y.shape[1]), dtype=np.float32)
    if _launch(native, rows, qweight, "blocked", False).run(rows, redo):
        raise MemoryError("quantized_gemm: the CPU kernel could not allocate its activation workspace")
    y[bad] = redo


def w8a8_column_tile(n: int, threads: int, m: int = 1, k_parts: int = 1) -> int:
    """Columns per task of the small-M W8A8 kernel: as wide as its accumulators allow (``W8A8_ACC_WORDS``
    over ``min(m, W8A8_SMALL_M_MAX)`` rows, a multiple of 64), in a multiple of the tasks per part of K.

    Each step of that kernel reads 8 code rows across the task's columns, so a wide task reads long
    contiguous runs of the ``[K, N]`` codes (what the hardware prefetchers follow, whatever ``N`` is):
    at M = 1 one range per thread, or, with K in ``k_parts`` parts, per thread of a part, up to 8192
    columns.
    """
    per_part = max(1, -(-max(1, threads) // max(1, k_parts)))
    widest = max(64, W8A8_ACC_WORDS // max(1, min(m, W8A8_SMALL_M_MAX)) // 64 * 64)
    tasks = per_part * -(-n // (widest * per_part))
    per_task = -(-n // tasks)
    return max(64, -(-per_task // 64) * 64)


def _group_runs(k: int, group_size: int, g_idx: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray,
                                                                               np.ndarray]:
    """``(perm, starts, groups)``: rows in an order where each group is contiguous, the runs' bounds, their groups."""
    if g_idx is None:
        return None, np.arange(0, k + 1, group_size, dtype=np.int64), np.arange(k // group_size, dtype=np.int32)
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    ordered = g_idx[perm]
    bounds = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate([[0], bounds, [k]]).astype(np.int64)
    return perm, starts, ordered[starts[:-1]].astype(np.int32)
