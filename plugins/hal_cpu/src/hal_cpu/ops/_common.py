"""Helpers shared by the CPU op implementations: output handling, workspaces, a chunk pool."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hal_core.arrays import BFLOAT16
from hal_core.ops import OpCall

from .. import _abi, _native
from ._native_args import fill_struct

__all__ = ["NARROW_CHUNK", "NARROW_NATIVE_MIN", "finish", "narrow", "parallel_for", "widen", "workspace"]

_local = threading.local()
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


#: Elements from which a float32 result is rounded to fp16 / bf16 by the compiled kernel (vectorised, in parallel
#: from NARROW_CHUNK elements) rather than numpy's single-threaded cast: the kernel's call costs about 4.5 us, numpy's
#: cast about 2.6 ns an element to fp16 and 1 ns to bf16 (2-core Zen 4), so below these the cast is cheaper.
NARROW_NATIVE_MIN = {np.dtype(np.float16): 2048, np.dtype(BFLOAT16): 5120}
#: Elements per parallel task of that rounding.
NARROW_CHUNK = 1 << 16
#: The kernels' codes of the narrow dtypes (HAL_F16, HAL_BF16).
_HALF_CODES = {np.dtype(np.float16): 1, np.dtype(BFLOAT16): 2}


def finish(call: OpCall, result: np.ndarray) -> np.ndarray:
    """The finished ``result`` in the op's dtype (hal writes the caller's ``out`` from it)."""
    return narrow(result, call.spec.output_dtype(call.args))


def narrow(result: np.ndarray, dtype: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``result`` in ``dtype``: a large contiguous float32 result rounded to fp16/bf16 by the compiled kernel
    (the bits numpy's ``astype`` gives: round to nearest even; a bf16 NaN is the quiet NaN of its sign), anything
    else by ``astype`` (no copy when the dtype is already right and no ``out`` is given).

    ``out``: a C-contiguous array of ``result``'s shape and ``dtype`` to write into (returned) instead of a new one.
    """
    dtype = np.dtype(dtype)
    native = None
    if result.dtype == np.float32 and dtype in _HALF_CODES and result.size >= NARROW_NATIVE_MIN[dtype] \
            and result.flags.c_contiguous:
        native = _native.try_load()
    if native is None:
        if out is None:
            return result.astype(dtype, copy=False)
        np.copyto(out, result, casting="unsafe")
        return out
    if out is None:
        out = np.empty(result.shape, dtype)
    args = fill_struct(_abi.FromFloat32Args, dict(x=_native.pointer(result), out=_native.pointer(out), n=result.size,
                                chunk=NARROW_CHUNK, dtype=_HALF_CODES[dtype], threads=native.threads))
    native.lib.hal_cpu_from_float32(ctypes.byref(args))
    return out


def workspace(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A scratch array of this thread, reused across calls (contents undefined).

    Reusing scratch memory avoids page-faulting fresh allocations on every
    chunk, which costs as much as the arithmetic here. Each thread keeps at
    most one buffer per name, as large as the largest request so far.
    """
    buffers: dict[str, np.ndarray] = _local.__dict__.setdefault("buffers", {})
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, 64), dtype=np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parallel_for(fn: Callable[[Any], None], items: Iterable[Any]) -> None:
    """Run ``fn`` on every item, spread over one thread per core (numpy releases the GIL)."""
    global _pool
    work = list(items)
    if len(work) <= 1 or _workers() == 1:
        for item in work:
            fn(item)
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_workers(), thread_name_prefix="hal-cpu-op")
        pool = _pool
    for future in [pool.submit(fn, item) for item in work]:
        future.result()


#: Elements widened per step: the passes of one step stay in L2.
_WIDEN_STEP = 1 << 16
_FP16_RESCALE = np.float32(2.0**112)  # fp16 exponent bias 15 -> fp32 bias 127


def widen(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Write contiguous fp16/bf16/fp32 ``src`` into contiguous float32 ``dst`` exactly; returns ``dst``.

    bf16 is the top half of an fp32, so it widens by a shift. fp16 widens by
    bit arithmetic (magnitude bits shifted into place, then one multiply by
    2**112 rebiases the exponent, subnormals included), in L2-sized steps:
    about twice as fast as numpy's scalar fp16 cast.
    """
    if src.dtype == BFLOAT16:
        bits = dst.view(np.uint32)
        np.copyto(bits, src.view(np.uint16), casting="unsafe")
        np.left_shift(bits, 16, out=bits)
        return dst
    if src.dtype != np.float16:
        np.copyto(dst, src, casting="same_kind")
        return dst
    flat_src, flat_dst = src.reshape(-1).view(np.uint16), dst.reshape(-1)
    sign = workspace("widen-sign", (min(_WIDEN_STEP, flat_src.size),), np.uint32)
    for start in range(0, flat_src.size, _WIDEN_STEP):  # chunks of 64K elements, not per element
        half = flat_src[start:start + _WIDEN_STEP]
        out = flat_dst[start:start + _WIDEN_STEP]
        bits, sgn = out.view(np.uint32), sign[: half.size]
        np.copyto(bits, half, casting="unsafe")
        np.bitwise_and(bits, 0x8000, out=sgn)
        np.bitwise_xor(bits, sgn, out=bits)
        special = bits.max(initial=0) >= 0x7C00
        if special:
            special_mask = bits >= 0x7C00
        np.left_shift(bits, 13, out=bits)
        if special:  # inf/nan: exponent all ones, kept so by the multiply (quietly, for signalling NaNs)
            bits[special_mask] |= np.uint32(0x70000000)
            with np.errstate(invalid="ignore"):
                np.multiply(out, _FP16_RESCALE, out=out)
        else:
            np.multiply(out, _FP16_RESCALE, out=out)
        np.left_shift(sgn, 16, out=sgn)
        np.bitwise_or(bits, sgn, out=bits)
    return dst
