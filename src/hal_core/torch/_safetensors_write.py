"""Writing safetensors files one tensor at a time, so a checkpoint is never held in memory whole.

The format (https://huggingface.co/docs/safetensors): an unsigned 64-bit
little-endian header length, the JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, padded with
spaces to a multiple of 8 bytes, as safetensors itself writes it), then the
tensors' little-endian bytes back to back, in header order. safetensors'
own writers take every tensor of a file at once (older versions copy each
into a bytes object first); here the header is planned from shapes and
dtypes, and each tensor is produced, written and dropped in turn.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ENTRY_DTYPES", "Entry", "write_safetensors"]

#: torch dtype -> (safetensors dtype code, bytes per element).
ENTRY_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float64: ("F64", 8), torch.float32: ("F32", 4), torch.float16: ("F16", 2), torch.bfloat16: ("BF16", 2),
    torch.int64: ("I64", 8), torch.int32: ("I32", 4), torch.int16: ("I16", 2), torch.int8: ("I8", 1),
    torch.uint64: ("U64", 8), torch.uint32: ("U32", 4), torch.uint16: ("U16", 2), torch.uint8: ("U8", 1),
    torch.bool: ("BOOL", 1), torch.float8_e4m3fn: ("F8_E4M3", 1), torch.float8_e5m2: ("F8_E5M2", 1),
}


#: numpy dtype name -> safetensors dtype code (bfloat16 is ml_dtypes').
_NUMPY_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
                "uint8": "U8", "bool": "BOOL"}


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name, torch dtype and shape, and ``read()`` giving its values when written.

    ``read`` returns a torch tensor (any device, any strides) or a numpy
    array of exactly this dtype and shape; it is called once, when the
    tensor's turn comes.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ENTRY_DTYPES[self.dtype][1]


def _bytes_of(entry: Entry) -> np.ndarray:
    """The entry's values as a flat uint8 host array (a view where the values already are on the host, contiguous)."""
    value = entry.read()
    code = ENTRY_DTYPES[entry.dtype][0]
    if isinstance(value, np.ndarray):
        got = _NUMPY_CODES.get(value.dtype.name)
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    else:
        got = ENTRY_DTYPES.get(value.dtype, ("?", 0))[0]
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    if got != code or tuple(value.shape) != entry.shape or data.size != entry.nbytes:
        raise RuntimeError(f"{entry.name}: planned as {entry.dtype} {entry.shape}, produced {value.dtype} "
                           f"{tuple(value.shape)}")
    return data


def write_safetensors(path: Path, entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> int:
    """Write ``entries`` to the safetensors file ``path`` in order, one tensor in memory at a time; return its size."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise RuntimeError("writing safetensors needs a little-endian host (the format stores little-endian values)")
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for entry in entries:
        if entry.name in header:
            raise ValueError(f"tensor name {entry.name!r} appears twice in one safetensors file")
        header[entry.name] = {"dtype": ENTRY_DTYPES[entry.dtype][0], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)))
        file.write(blob)
        for entry in entries:
            file.write(_bytes_of(entry).data)
    return 8 + len(blob) + offset
