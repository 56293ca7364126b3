"""``sample`` on the host: one token per row (csrc/sample.inl), rows in parallel, SIMD within a row.

``logits`` may have strided rows (the last dimension contiguous); the per-row parameters are passed as they
are (the optional ones as NULL when not given). Without the compiled library the float64 definition of
:mod:`hal_core.ops.sample` runs instead (the same tokens, up to rounding at a CDF boundary).
"""

from __future__ import annotations

import ctypes

import numpy as np

from hal_core.ops import OPS, OpCall, Runner

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, fill_struct, last_contiguous
from ._planned import struct_runner

__all__ = ["draw_tokens", "plan_sample", "sample"]

#: The per-row arguments, as the kernel's struct names them (the optional ones NULL when not given).
_ROW_ARGS = ("temperature", "top_k", "top_p", "min_p", "seeds")
_ENOMEM = "sample: the CPU kernel could not allocate its workspace (one row of float32 per thread)"


def sample(call: OpCall) -> np.ndarray:
    """The token of each row of ``logits`` (int64; -1 for a row holding NaN or only -inf)."""
    optional = (None if call.args.get(n) is None else np.asarray(call[n]) for n in ("top_k", "top_p", "min_p"))
    return draw_tokens(np.asarray(call["logits"]), np.asarray(call["temperature"]), np.asarray(call["seeds"]),
                       *optional)


def draw_tokens(logits: np.ndarray, temperature: np.ndarray, seeds: np.ndarray, top_k: np.ndarray | None = None,
                top_p: np.ndarray | None = None, min_p: np.ndarray | None = None, *,
                threads: int | None = None) -> np.ndarray:
    """The kernel on validated numpy inputs (``threads`` defaults to :func:`~hal_cpu.ops._rules.threads_for`)."""
    num_seqs, vocab = logits.shape
    out = np.empty(num_seqs, dtype=np.int64)
    if num_seqs == 0:
        return out
    native = _native.try_load()
    if native is None:
        return np.asarray(OPS["sample"].reference({"logits": logits, "temperature": temperature, "seeds": seeds,
                                                   "top_k": top_k, "top_p": top_p, "min_p": min_p}))
    logits = last_contiguous(logits)
    temperature, seeds = np.ascontiguousarray(temperature), np.ascontiguousarray(seeds)
    top_k, top_p, min_p = (None if a is None else np.ascontiguousarray(a) for a in (top_k, top_p, min_p))
    if threads is None:
        threads = _rules.threads_for(logits.itemsize * num_seqs * vocab, native.threads)
    args = fill_struct(_abi.SampleArgs, dict(
        logits=_native.pointer(logits), logits_stride=logits.strides[0] // logits.itemsize if num_seqs > 1 else vocab,
        temperature=_native.pointer(temperature), top_k=_native.pointer(top_k), top_p=_native.pointer(top_p),
        min_p=_native.pointer(min_p), seeds=_native.pointer(seeds), out=_native.pointer(out), num_seqs=num_seqs,
        vocab_size=vocab, dtype=dtype_code(logits), threads=int(threads)))
    if native.lib.hal_cpu_sample(ctypes.byref(args)):
        raise MemoryError(_ENOMEM)
    return out


def plan_sample(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`), or None where the kernel cannot take its arrays as
    they are (rows not last-contiguous, a per-row argument strided) or there are no rows."""
    native = _native.try_load()
    logits = call["logits"]
    rows = {name: call.args.get(name) for name in _ROW_ARGS}
    if native is None or logits.shape[0] == 0 or last_contiguous(logits) is not logits \
            or any(a is not None and not a.flags.c_contiguous for a in rows.values()):
        return None
    num_seqs, vocab = logits.shape
    threads = _rules.threads_for(logits.itemsize * num_seqs * vocab, native.threads)
    fields = dict(logits=logits, logits_stride=logits.strides[0] // logits.itemsize if num_seqs > 1 else vocab,
                  **rows, out=None, num_seqs=num_seqs, vocab_size=vocab, dtype=dtype_code(logits),
                  threads=int(threads))
    return struct_runner(call, sample, native.lib.hal_cpu_sample, _abi.SampleArgs, fields,
                         {"logits": "logits", **{name: name for name in _ROW_ARGS}},
                         out=("out", (num_seqs,), np.dtype(np.int64)), enomem=_ENOMEM)
