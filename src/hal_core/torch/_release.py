"""Moving a model's tensors out of file mappings, so the mapped checkpoint can be unmapped.

``from_pretrained`` maps a safetensors file and the model's tensors are
views into that mapping: while any of them lives, the whole mapping does,
and every page of it that was read stays resident (``quantize_model`` reads
them all). :func:`move_out_of_file_mappings` gives each CPU parameter and
buffer that lies in a file mapping a fresh copy in anonymous memory, one
storage at a time, so once the model holds no view of it the mapping goes.
Parameters keep their identity (``p.data`` is re-pointed: weights tied to
one ``Parameter`` stay tied); buffers are replaced by new tensors, so a
layer that caches views of its buffers (``QuantLinear``) rebuilds them.

The mappings are read from ``/proc/self/maps``; where there is none
(not Linux) nothing is moved. A file deleted since it was mapped still
counts (its pages stay resident just the same); shared memory
(``/dev/shm``, which torch's multiprocessing uses, memfd and System V
segments) is left alone.

:func:`drop_file_pages` lets the kernel take back this process's pages of
mapped files it has read and copied (``madvise(MADV_DONTNEED)``): the
mapping stays valid, a later read of it faults its pages back in from the
file, so the checkpoint's pages do not stay resident beside their copies
while a loader converts one layer after another.

:func:`return_free_heap` hands the C heap's free pages back to the system
(glibc's ``malloc_trim``): quantizing frees one float64 transient per
layer, and glibc keeps up to a few such blocks in the process otherwise.
"""

from __future__ import annotations

import bisect
import ctypes
from pathlib import Path

import torch

__all__ = ["drop_file_pages", "file_mappings", "move_out_of_file_mappings", "return_free_heap"]

#: Mappings that are shared memory, not a file's pages: left alone (torch's multiprocessing tensors live there).
_SHARED = ("/dev/", "/memfd:", "/SYSV")


def file_mappings() -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every mapping of a regular file into this process, sorted; [] off Linux."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[4] == "0":  # no inode: anonymous memory, heap, stack
            continue
        path = parts[5]
        if not path.startswith("/") or path.startswith(_SHARED):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        found.append((start, end, path))
    found.sort()
    return found


def _mapped(address: int, mappings: list[tuple[int, int, str]], starts: list[int]) -> bool:
    at = bisect.bisect_right(starts, address) - 1
    return at >= 0 and mappings[at][0] <= address < mappings[at][1]


def move_out_of_file_mappings(model: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer of ``model`` that lies in a file mapping; returns the bytes copied.

    Tensors sharing a storage are copied together (the span they cover, so
    views stay views of one another); the copy of one storage is done
    before the next is read.
    """
    mappings = file_mappings()
    if not mappings:
        return 0
    starts = [m[0] for m in mappings]
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> the distinct tensors on it
    seen: set[int] = set()
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is None or id(tensor) in seen or tensor.device.type != "cpu" or tensor.is_sparse:
                continue
            seen.add(id(tensor))
            address = tensor.untyped_storage().data_ptr()
            if address and _mapped(address, mappings, starts):
                groups.setdefault(address, []).append(tensor)
    copied = 0
    for tensors in groups.values():
        fresh, nbytes = _copy_storage(tensors)
        copied += nbytes
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) in fresh:
                    module._buffers[name] = fresh[id(buffer)]
        for tensor in tensors:
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = fresh[id(tensor)]
        del fresh
    return copied


def _copy_storage(tensors: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], int]:
    """Fresh tensors (by ``id`` of the original) over one new anonymous copy of the bytes the originals span."""
    lo = min(_start_byte(t) for t in tensors)
    lo -= lo % 16  # a multiple of every element size: each tensor's offset stays a whole number of elements
    hi = max(_end_byte(t) for t in tensors)
    source = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
    storage = source[lo:hi].clone().untyped_storage()
    del source
    fresh = {}
    for t in tensors:
        offset = (_start_byte(t) - lo) // t.element_size()
        fresh[id(t)] = torch.empty(0, dtype=t.dtype).set_(storage, offset, t.shape, t.stride())
    return fresh, hi - lo


def _start_byte(t: torch.Tensor) -> int:
    return int(t.storage_offset()) * t.element_size()


def _end_byte(t: torch.Tensor) -> int:
    """One past the last byte ``t`` reads in its storage (its start when it is empty)."""
    if t.numel() == 0:
        return _start_byte(t)
    last = sum((int(extent) - 1) * int(stride) for extent, stride in zip(t.shape, t.stride(), strict=True))
    return _start_byte(t) + (last + 1) * t.element_size()


def return_free_heap() -> bool:
    """Return the C heap's free pages to the system where the C library can (glibc); whether it could."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (musl, macOS, Windows): the allocator keeps what it keeps
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


#: ``madvise``'s advice that the pages are not needed (Linux's value on x86, Arm and most architectures).
_MADV_DONTNEED = 4


def drop_file_pages(paths: set[str]) -> int:
    """Advise the kernel that this process no longer needs its resident pages of every mapping of the files
    ``paths`` (resolved paths, as ``/proc/self/maps`` names them); returns the bytes of those mappings, 0 where
    there are none or the C library has no ``madvise``. Only for read-only mappings of unchanged files (a
    loader's): a later read of the mapping faults the same bytes back in from the file."""
    mappings = [(start, end) for start, end, path in file_mappings() if path in paths]
    if not mappings:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advised = 0
    for start, end in mappings:
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            advised += end - start
    return advised
