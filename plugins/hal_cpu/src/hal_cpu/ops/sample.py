"""``sample`` on the host: one token per row (csrc/sample.inl), rows in parallel, SIMD within a row.

``logits`` may have strided rows (the last dimension contiguous); the per-row parameters are passed as they
are (the optional ones as NULL when not given). Without the compiled library the float64 definition of
:mod:`hal_core.ops.sample` runs instead (the same tokens, up to rounding at a CDF boundary).
"""

from __future__ import annotations

import ctypes

import numpy as np

from hal_core.ops import OPS, OpCall

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, fill_struct, last_contiguous

__all__ = ["draw_tokens", "sample"]


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
        raise MemoryError("sample: the CPU kernel could not allocate its workspace (one row of float32 per thread)")
    return out
