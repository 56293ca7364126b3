"""A torch-free reader of safetensors files: each tensor a read-only numpy view of the file's mapping.

Only the header is parsed eagerly; a tensor's pages are read when it is used
(the mapping is shared by every tensor of the file), and :meth:`SafetensorsFile.drop_pages` lets the process
give back the pages it has read once it has what it needs of them. Every entry is checked
against the file before it is handed out: a known dtype, a shape whose bytes
equal its span, a span inside the data section.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CheckpointError
from ..arrays import BFLOAT16

__all__ = ["SafetensorsFile"]

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": BFLOAT16,
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 2**20


class SafetensorsFile(Mapping[str, np.ndarray]):
    """The tensors of one ``.safetensors`` file by name (a read-only mapping; nothing is copied)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            size = self.path.stat().st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: not a safetensors file ({size} bytes)")
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{self.path}: header length {header_len} exceeds the file's {size - 8} bytes "
                                      f"after it (or the {_MAX_HEADER}-byte limit): truncated or not safetensors")
            try:
                header = json.loads(handle.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{self.path}: unreadable header ({exc})") from None
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{self.path}: __metadata__ is not a JSON object")
        self.metadata: dict[str, str] = metadata
        self._base = 8 + header_len
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        self._codes: dict[str, str] = {}
        for name, entry in header.items():
            self._entries[name] = self._check(name, entry, size - self._base)
            self._codes[name] = entry["dtype"]

    def _check(self, name: str, entry: Any, data_bytes: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where}: malformed entry {entry!r} (expected dtype, shape, data_offsets)")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in _DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {code!r} (known: {', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} lie outside the file's {data_bytes} data bytes")
        dtype, (start, stop) = _DTYPES[code], offsets
        needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if needed != stop - start:
            raise CheckpointError(f"{where}: {code} {shape} needs {needed} bytes, its data_offsets span {stop - start}")
        return dtype, tuple(shape), start, stop

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, start, stop = self._entries[name]
        if start == stop:
            return np.zeros(shape, dtype)
        assert self._map is not None
        return np.frombuffer(self._map, dtype, count=(stop - start) // dtype.itemsize,
                             offset=self._base + start).reshape(shape)

    def drop_pages(self) -> None:
        """Let the kernel take back this process's resident pages of the file (``MADV_DONTNEED``, where the
        platform has it): views handed out stay valid, a later read faults its pages back in from the file."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the header (nothing read)."""
        return self._entries[name][1]

    def dtype_code(self, name: str) -> str:
        """A tensor's safetensors dtype (``"BF16"``, ``"I32"``, ...), from the header."""
        return self._codes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
