"""The device error flag: index errors the kernels found, raised on the host at hal's synchronisation points.

The kernels that read block tables, lengths and slots check every value
they use (``kernels/hal_index_checks.cuh``). A bad one is never
dereferenced; the kernel ORs the code of its argument into one int32 per
device. An op call only passes that buffer's address to its launches (no
copy, no synchronisation: capturable in a CUDA graph, where replays write
the same buffer). The host reads it at the synchronisation points hal
controls -- :meth:`CupyStream.synchronize`, :meth:`CupyEvent.synchronize`,
:meth:`CupyDevice.synchronize` -- and at :func:`hal_core.check_errors`,
clears it, and raises :class:`~hal_core.ArgumentError` naming the argument.

A device's flag is made on its first checked launch, so run each op once
before capturing a graph (which is needed anyway, to compile the kernels).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hal_core import ArgumentError

from ._cupy import cupy

__all__ = ["ERROR_ARGUMENTS", "error_flag", "forget_flags", "has_flag", "raise_recorded"]

#: Flag bits (``HAL_ERR_*`` of ``hal_index_checks.cuh``) and the argument each names.
ERROR_ARGUMENTS: dict[int, str] = {1: "block_tables", 2: "seq_lens", 4: "slot_mapping", 8: "query_start_loc"}
# sample.cu's parameter checks, rotary_embedding.cu's positions (each kernel defines its own bits: distinct)
ERROR_ARGUMENTS.update({16: "temperature", 32: "top_p", 64: "min_p", 128: "positions"})

_WHAT = {
    "block_tables": "a used entry outside [0, num_blocks); that sequence's output rows were written as zeros",
    "seq_lens": "a length below 0 or beyond min(max_seq_len, max_blocks_per_seq * block_size); that sequence's "
                "output rows were written as zeros",
    "slot_mapping": "a slot at or past num_blocks * block_size; that token was not written",
    "query_start_loc": "offsets not starting at 0, decreasing or not ending at num_tokens (every output row was "
                       "written as zeros), or a sequence with more new tokens than its seq_lens entry or "
                       "max_query_len (that sequence's output rows were written as zeros)",
    "temperature": "a negative or non-finite value; that row's token was written as -1",
    "top_p": "a value outside (0, 1]; that row's token was written as -1",
    "min_p": "a value outside [0, 1]; that row's token was written as -1",
    "positions": "a position outside [0, max_position) (the rows of cos_sin_cache); that token's query and key "
                 "were left as they were",
}

_flags: dict[int, Any] = {}
_lock = threading.Lock()


def error_flag(device_index: int) -> Any:
    """The device's int32 error flag (a 1-element CuPy array, zeroed when made), made on first use."""
    flag = _flags.get(device_index)
    if flag is None:
        with _lock:
            flag = _flags.get(device_index)
            if flag is None:
                cp = cupy()
                with cp.cuda.Device(device_index):
                    flag = cp.zeros((1,), dtype=np.int32)
                _flags[device_index] = flag
    return flag


def has_flag(device_index: int) -> bool:
    """Whether a kernel of this device may have written its flag (one was made for it)."""
    return device_index in _flags


def raise_recorded(device_index: int) -> None:
    """Read the device's flag (on the current stream, a 4-byte copy), clear it, raise what it records.

    Call it after the work to check has completed (a synchronisation):
    the read waits only for the current stream.
    """
    flag = _flags.get(device_index)
    if flag is None:
        return
    cp = cupy()
    with cp.cuda.Device(device_index):
        code = int(flag.get()[0])
        if code == 0:
            return
        flag.fill(0)
    names = [name for bit, name in ERROR_ARGUMENTS.items() if code & bit]
    details = "; ".join(f"argument {name!r}: {_WHAT[name]}" for name in names)
    raise ArgumentError(
        f"a kernel on device {device_index} found bad index values ({details}). The check ran on the device "
        f"while the op was queued, so the error is reported at this synchronisation; fix the engine's "
        f"{' / '.join(names)} (pass them as host numpy arrays once to have the first bad entry named)"
    )


def forget_flags() -> None:
    """Drop every device's flag (a backend reset; graphs captured before keep a stale address)."""
    with _lock:
        _flags.clear()
